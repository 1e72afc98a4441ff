"""The virtual-time round model (sim/scale.py) against closed forms computed here with numpy."""
from __future__ import annotations

import numpy as np
import pytest

from lioncub_p2p import ops
from lioncub_p2p.allreduce.hierarchy import two_level_layout
from lioncub_p2p.allreduce.partition import PeerSpec, part_bounds
from lioncub_p2p.sim.scale import Network, flat_round, two_level_round

FAST = 1e15  # bytes/s: links that take no time


def _latency_only(access: np.ndarray) -> Network:
    n = len(access)
    return Network(np.full(n, FAST), np.full(n, FAST), access, per_message_s=0.0, header_bytes=0)


def test_flat_round_on_latency_alone_is_the_slowest_vote_then_the_slowest_result():
    access = np.random.default_rng(1).uniform(0.005, 0.04, 9)
    n = len(access)
    # reducer j has all votes when the furthest voter's arrives; peer k has every part when the last
    # reducer's result arrives (its own part: when it has reduced it)
    reduced = np.array([max(access[i] + access[j] for i in range(n) if i != j) for j in range(n)])
    expected = np.array([max([reduced[k]] + [reduced[j] + access[j] + access[k] for j in range(n) if j != k])
                         for k in range(n)])
    timing = flat_round(_latency_only(access), 10_000)
    np.testing.assert_allclose(timing.finished, expected, rtol=1e-9)


def test_two_level_round_on_latency_alone_crosses_four_paths():
    n, numel = 11, 20_000
    access = np.random.default_rng(2).uniform(0.005, 0.04, n)
    ids = [f"peer{i}" for i in range(n)]
    layout = two_level_layout(ids, 0, (numel + 7) // 8, max_size=4)
    groups = [[ids.index(p) for p in g] for g in layout.groups]
    G, P = len(groups), len(layout.parts)

    def path(a: int, b: int) -> float:
        return 0.0 if a == b else access[a] + access[b]

    counted = {(b, k): max([0.0] + [path(v, groups[b][k]) for v in groups[b] if v != groups[b][k]])
               for b in range(G) for k in range(P)}
    combined = {(q, k): max(counted[b, k] + path(groups[b][k], groups[q][k]) for b in range(G))
                for q in range(G) for k in range(P)}
    done = {(a, k): max(combined[q, k] + path(groups[q][k], groups[a][k]) for q in range(G))
            for a in range(G) for k in range(P)}
    expected = np.zeros(n)
    for a, members in enumerate(groups):
        for x in members:
            expected[x] = max(done[a, k] + path(groups[a][k], x) for k in range(P))
    timing = two_level_round(_latency_only(access), numel, max_size=4)
    np.testing.assert_allclose(timing.finished, expected, rtol=1e-9)


def test_two_peers_on_bandwidth_alone_take_two_uploads_of_half_the_bytes_the_downlink_streaming_alongside():
    numel, rate, header = 80_000, 1e6, 40
    net = Network(np.full(2, rate), np.full(2, 10 * rate), np.zeros(2), per_message_s=0.001, header_bytes=header)
    half = numel // 8 // 2 + header
    # vote: CPU, uplink (the downlink streams alongside), CPU; then the result the same way back
    assert flat_round(net, numel).round_s == pytest.approx(2 * (2 * 0.001 + half / rate))


def test_one_group_two_level_round_is_the_flat_round_in_the_groups_order():
    n, numel = 12, 1 << 16
    net = Network.draw(n, seed=3, per_message_s=2e-4)
    ids = [f"peer{i}" for i in range(n)]
    (order,) = two_level_layout(ids, 0, numel // 8, max_size=32).groups
    perm = [ids.index(p) for p in order]
    permuted = Network(net.up[perm], net.down[perm], net.access_s[perm], net.per_message_s, net.header_bytes)
    flat, two = flat_round(permuted, numel), two_level_round(net, numel, max_size=32)
    np.testing.assert_allclose(two.finished[perm], flat.finished, rtol=1e-12)
    np.testing.assert_array_equal(two.bytes_up[perm], flat.bytes_up)


@pytest.mark.parametrize("n, max_size", [(40, 8), (65, 32), (3, 1)])
def test_message_and_byte_counts_follow_the_layout(n, max_size):
    numel, header = 1 << 18, 80
    nbytes = numel // 8
    net = Network.draw(n, seed=n, header_bytes=header)
    ids = [f"peer{i}" for i in range(n)]
    layout = two_level_layout(ids, 0, nbytes, max_size)
    G, P = len(layout.groups), len(layout.parts)
    timing = two_level_round(net, numel, max_size=max_size)
    sizes = [len(g) for g in layout.groups]
    votes = sum(g * P - P for g in sizes)  # every member sends every part but its own
    messages = votes + P * G * 2 * (G - 1) + sum(P * (g - 1) for g in sizes)
    assert timing.messages.sum() == messages
    part_bytes = sum(stop - start for start, stop in layout.parts)
    own_slices = [sum(layout.slices[k][a][1] - layout.slices[k][a][0] for k in range(P)) for a in range(G)]
    payload = (2 * sum((g - 1) * part_bytes for g in sizes)  # votes up, results down
               + sum(ops.planes_needed(g) * (part_bytes - own) for g, own in zip(sizes, own_slices))  # counts
               + (G - 1) * part_bytes)  # slice majorities
    assert timing.bytes_up.sum() == payload + header * messages
    assert timing.bytes_up.sum() == timing.bytes_down.sum()
    flat = flat_round(net, numel)
    assert flat.messages.sum() == 2 * n * (n - 1)
    assert flat.bytes_up.sum() == 2 * (n - 1) * nbytes + header * 2 * n * (n - 1)


def test_a_slow_downlink_serves_its_messages_one_after_another():
    """Three peers, every link instantaneous but peer 0's downlink: it takes in the two votes on its
    part and the two other parts' results back to back; the others wait for its votes to be in."""
    numel, rate = 3 * 8 * 1000, 1e6
    down = np.array([rate, FAST, FAST])
    net = Network(np.full(3, FAST), down, np.zeros(3), per_message_s=0.0, header_bytes=0)
    s = [stop - start for start, stop in part_bounds(numel // 8, [PeerSpec(str(i)) for i in range(3)])]
    timing = flat_round(net, numel)
    assert timing.finished[0] == pytest.approx((2 * s[0] + s[1] + s[2]) / rate, rel=1e-6)
    assert (timing.finished[1:] >= 2 * s[0] / rate * (1 - 1e-6)).all()
    assert (timing.finished[1:] <= timing.finished[0] * (1 + 1e-6)).all()
