"""Two-level votes (allreduce/hierarchy.py) against numpy and the flat vote."""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

from lioncub_p2p import codecs, ops
from lioncub_p2p.allreduce import hierarchy
from lioncub_p2p.allreduce.hierarchy import (assign_groups, combine_counts, group_counts, majority_of_majorities,
                                             upward_bits)


def _votes(n: int, nbytes: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, nbytes), dtype=np.uint8))


@contextlib.contextmanager
def _audited_two_level(seed: int):
    """13 LocalSwarm peers voting two-level in groups of at most 4 (a group of 3 among them), every
    voter auditing 2 parts and comparing a slice every round: (swarm, votes, ids, layout)."""
    from lioncub_p2p.testing import FAST_CONFIG, LocalSwarm

    n, nbytes = 13, 4096
    config = dataclasses.replace(FAST_CONFIG, audits_per_round=2, slice_audit_rate=1.0)
    with LocalSwarm(n, config=config) as swarm:
        ids = [p.peer_id for p in swarm.group]
        yield swarm, _votes(n, nbytes, seed=seed), ids, hierarchy.two_level_layout(ids, 0, nbytes, max_size=4)


def _np_majority(stack: np.ndarray) -> np.ndarray:
    """Bits (n, nbytes*8) -> 1 where more than half are 1 (ties left to the caller: -1)."""
    counts = np.unpackbits(stack, axis=1, bitorder="little").sum(axis=0).astype(np.int64)
    n = stack.shape[0]
    return np.where(counts * 2 > n, 1, np.where(counts * 2 == n, -1, 0))


def test_groups_partition_the_members_evenly_the_same_whatever_the_order_and_change_with_the_epoch():
    peers = [f"peer{i}" for i in range(70)]
    groups = assign_groups(peers, epoch=3, max_size=32)
    assert len(groups) == 3 and sorted(len(g) for g in groups) == [23, 23, 24]
    assert sorted(p for g in groups for p in g) == sorted(peers)
    assert assign_groups(list(reversed(peers)), epoch=3, max_size=32) == groups
    assert assign_groups(peers, epoch=4, max_size=32) != groups
    (few,) = assign_groups(peers[:5], epoch=0, max_size=32)  # one group under the cap
    assert sorted(few) == peers[:5]
    assert assign_groups([], epoch=0) == []
    with pytest.raises(ValueError):
        assign_groups(["a", "a"], epoch=0)


def test_members_that_cannot_reduce_are_spread_after_the_reducers_and_never_get_a_part():
    peers = [f"peer{i}" for i in range(20)]
    reducers = set(peers[:14])  # six behind NAT, syncing or following: no part
    groups = assign_groups(peers, epoch=1, max_size=8, reducers=reducers)
    assert assign_groups(peers[::-1], epoch=1, max_size=8, reducers=reducers) == groups
    assert len(groups) == 3 and sorted(len(g) for g in groups) == [6, 7, 7]
    assert sorted(p for g in groups for p in g) == sorted(peers)
    layout = hierarchy.two_level_layout(peers, 1, 4096, max_size=8, reducers=reducers)
    assert len(layout.parts) == min(sum(p in reducers for p in g) for g in groups) == 4
    assert all(layout.reducer(q, k) in reducers for q in range(3) for k in range(4))
    specs = hierarchy.two_level_specs(b"r", 0, layout, 4096)
    reducing = {p.peer_id for spec in specs.values() for p in spec.group if p.reduces}
    assert reducing <= reducers
    assert len(assign_groups(peers, epoch=1, max_size=2, reducers={"peer3", "peer7"})) == 2  # one per reducer
    assert sorted(map(len, assign_groups(peers[:5], epoch=1, max_size=2, reducers={"peer0", "peer1", "peer2"}))) \
        == [2, 3]  # never a group of one
    with pytest.raises(ValueError):
        assign_groups(peers, epoch=1, reducers=set())
    spec = next(iter(specs.values()))
    with pytest.raises(ValueError, match="majority of signs"):  # the margins are counts of 1-bit votes
        dataclasses.replace(spec, upload=codecs.L1Upload(4))


@pytest.mark.parametrize("n, sizes", [(12, 4), (13, 4), (64, 16), (65, 32), (40, 40)])
def test_exact_counts_combined_are_the_flat_majority_bit_for_bit(n, sizes):
    stack = _votes(n, 64, seed=n)
    flat = ops.majority_vote(stack, seed=5, step=9)
    groups = [list(range(i, n, -(-n // sizes))) for i in range(-(-n // sizes))]
    planes = [group_counts(stack[g]) for g in groups]
    combined = combine_counts(planes, [len(g) for g in groups], seed=5, step=9)
    assert torch.equal(combined, flat)
    ref = _np_majority(stack.numpy())  # independent of ops: where no tie, numpy says the same
    bits = np.unpackbits(combined.numpy(), bitorder="little")
    decided = ref >= 0
    assert np.array_equal(bits[decided], ref[decided]) and (n % 2 == 1) == decided.all()


def test_a_parts_offset_picks_the_tie_bits_of_its_place_in_the_whole_buffer():
    stack = _votes(8, 32, seed=1)
    whole = combine_counts([group_counts(stack[:4]), group_counts(stack[4:])], [4, 4], seed=2, step=3)
    part = combine_counts([group_counts(stack[:4, 16:]), group_counts(stack[4:, 16:])], [4, 4], seed=2, step=3,
                          offset=16)
    assert torch.equal(part, whole[16:])


@pytest.mark.parametrize("sizes, left_out", [((4, 4, 4), None), ((5, 4, 3), None), ((32, 31, 7, 1), None),
                                             ((6, 5, 5), 1)])
def test_margins_summed_by_an_ordinary_l1_reducer_are_the_flat_majority_bit_for_bit(sizes, left_out):
    """The second level as an ordinary round: each group's margin as L1 codes, tallied and thresholded by
    the reducer's own code (``codecs.tally_of`` + ``MajorityResult``), gives the flat majority of every
    counted voter, ties included; a group left out gives that of the others' voters."""
    n, nbytes = sum(sizes), 48
    stack = _votes(n, nbytes, seed=n)
    stack[:, :4] = 0b01010101  # many exact ties wherever the counted voters are even
    starts = np.cumsum((0,) + sizes)
    groups = [list(range(a, b)) for a, b in zip(starts[:-1], starts[1:])]
    bits = hierarchy.margin_bits(max(sizes))
    codec = codecs.L1Upload(bits)
    counted = [g for q, g in enumerate(groups) if q != left_out]
    margins = [hierarchy.margin_codes(group_counts(stack[g]), len(g), bits) for g in counted]
    combined = codecs.MajorityResult().encode(codecs.tally_of(codec, margins), len(margins) * codec.max_code,
                                              8 * nbytes, seed=5, step=9)
    voters = [v for g in counted for v in g]
    assert torch.equal(combined, ops.majority_vote(stack[voters], seed=5, step=9))
    ref = _np_majority(stack[voters].numpy())  # independent of ops where no tie
    got = np.unpackbits(combined.numpy(), bitorder="little")
    decided = ref >= 0
    assert np.array_equal(got[decided], ref[decided]) and (len(voters) % 2 == 1) == decided.all()
    with pytest.raises(ValueError):
        hierarchy.margin_codes(group_counts(stack[:8]), 8, 4)  # 8 voters need 5 bits


def test_majority_of_majorities_is_numpys_and_can_differ_from_the_flat_majority():
    # group A: 3 of 3 say 1; groups B and C: 1 of 3 say 1 -> flat 5 of 9 (1), groups 1 of 3 (0)
    rows = [[1, 1, 1], [1, 0, 0], [1, 0, 0]]
    stack = torch.tensor([[0xFF if bit else 0 for _ in range(4)] for group in rows for bit in group], dtype=torch.uint8)
    groups = [stack[0:3], stack[3:6], stack[6:9]]
    results = torch.stack([ops.majority_vote(g) for g in groups])
    mom = majority_of_majorities(results)
    assert torch.equal(ops.majority_vote(stack), torch.full((4,), 0xFF, dtype=torch.uint8))
    assert torch.equal(mom, torch.zeros(4, dtype=torch.uint8))
    rng = np.random.default_rng(0)
    stack = torch.from_numpy(rng.integers(0, 256, (15, 64), dtype=np.uint8))
    results = torch.stack([ops.majority_vote(stack[i:i + 5]) for i in range(0, 15, 5)])
    expected = np.packbits(_np_majority(results.numpy()), bitorder="little")  # 3 groups: never a tie
    assert np.array_equal(majority_of_majorities(results).numpy(), expected)


@pytest.mark.parametrize("max_size", [2, 3, 4, 32])
def test_no_member_is_alone_in_a_group_its_size_over_the_cap_by_one_at_most(max_size):
    """A lone member of a group has no group-mate to count its votes or report them missed (lead.py)."""
    for n in range(2, 70):
        ids = [f"p{i}" for i in range(n)]
        for epoch in range(3):
            sizes = sorted(map(len, assign_groups(ids, epoch, max_size)))
            assert sum(sizes) == n and sizes[-1] - sizes[0] <= 1, (n, sizes)
            assert sizes[0] >= 2, (n, max_size, sizes)
            assert sizes[-1] <= max_size or (max_size == 2 and n % 2 == 1 and sizes[-1] == 3), (n, sizes)
            assert len(sizes) == max(1, min(-(-n // max_size), n // 2))  # as many groups as the cap asks


def test_upward_bits_and_bad_inputs():
    assert upward_bits([32, 32, 31], "counts") == 6 + 6 + 5 and upward_bits([32, 32, 31], "majority") == 3
    with pytest.raises(ValueError):
        combine_counts([group_counts(_votes(3, 8, 0))], [4])  # 4 voters do not fit in 2 planes
    with pytest.raises(ValueError):
        combine_counts([], [])


@pytest.mark.parametrize("n, max_size, nbytes", [(1, 32, 64), (7, 3, 1000), (64, 32, 1 << 17), (65, 32, 1 << 17)])
def test_two_level_layout_covers_the_buffer_once_per_level_and_names_a_reducer_in_every_group(n, max_size, nbytes):
    ids = [f"p{i}" for i in range(n)]
    layout = hierarchy.two_level_layout(ids, 5, nbytes, max_size)
    assert layout == hierarchy.two_level_layout(ids[::-1], 5, nbytes, max_size)  # any member order
    assert [list(g) for g in layout.groups] == hierarchy.assign_groups(ids, 5, max_size)
    smallest = min(len(g) for g in layout.groups)
    assert len(layout.parts) == smallest
    coverage = np.zeros(nbytes, dtype=int)
    for k, (start, stop) in enumerate(layout.parts):
        coverage[start:stop] += 1
        slices = layout.slices[k]
        assert len(slices) == len(layout.groups)
        assert slices[0][0] == start and slices[-1][1] == stop
        assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))  # contiguous
        assert {layout.reducer(g, k) for g in range(len(layout.groups))} <= set(ids)
    assert (coverage == 1).all()


def _two_level_expected(stack: torch.Tensor, layout, ids: list[str], reports, *, seed: int, step: int) -> torch.Tensor:
    """What a two-level vote must give, from who was counted: each slice of each part is the flat majority
    (``ops.majority_vote``, its tie stream at the slice's place) of the voters its group counted, over
    the groups that its combiner counted (a group late at the combiner is left out of that slice)."""
    out = torch.zeros(stack.shape[1], dtype=torch.uint8)
    for k, _ in enumerate(layout.parts):
        combiner_view = reports[ids.index(layout.groups[0][k])].combine
        for q, (a, b) in enumerate(layout.slices[k]):
            voters = []
            for g in combiner_view.parts[q].counted:
                members = layout.groups[g]
                first_level = next(reports[ids.index(m)] for m in members if reports[ids.index(m)] is not None)
                voters += [ids.index(members[v]) for v in first_level.parts[k].counted]
            out[a:b] = ops.majority_vote(stack[sorted(voters)], seed=seed, step=step)[a:b]
    return out


@pytest.mark.slow
def test_a_two_level_vote_on_the_wire_gives_every_peer_the_flat_majority_bit_for_bit():
    """13 VoteNodes over libp2p in groups of at most 4 (4, 3, 3, 3: one member of the group of 4 reduces
    nothing): each group votes, each part's reducers combine their groups' margins in a second-level
    round, and every peer gets the same update: the flat majority of all 13 votes wherever every group
    and voter was counted (numpy where no tie; the tie stream at each slice's place in the buffer); a
    group late at a combiner is left out of that slice, for every peer alike. Then that member stays
    silent: its group comes late (it waits for it) and the 12 others' votes decide, ties included."""
    from lioncub_p2p.testing import FAST_CONFIG, LocalSwarm

    n, nbytes = 13, 4096
    stack = _votes(n, nbytes, seed=21)
    with LocalSwarm(n, config=FAST_CONFIG) as swarm:
        ids = [p.peer_id for p in swarm.group]
        layout = hierarchy.two_level_layout(ids, 0, nbytes, max_size=4)
        assert sorted(len(g) for g in layout.groups) == [3, 3, 3, 4]
        partless = ids.index(next(g[3] for g in layout.groups if len(g) == 4))
        runs = []
        for step, absent in ((3, []), (4, [partless])):
            results = swarm.two_level(list(stack), max_size=4, step=step, seed=5, absent=absent)
            runs.append((step, absent, results, list(swarm.reports)))
        swarm.settle_audits()  # the combiners audit each other's slices: tie offset included, nobody lied
        audited = sum(r.combine.audit is not None for _, _, _, reports in runs for r in reports
                      if r is not None and r.combine is not None)
        assert audited >= 12 and not any(node.caught for node in swarm.nodes), [n.caught for n in swarm.nodes]
    for step, absent, results, reports in runs:
        expected = _two_level_expected(stack, layout, ids, reports, seed=5, step=step)
        for i, result in enumerate(results):
            assert (result is None) == (i in absent) and (result is None or torch.equal(result, expected)), (step, i)
        combined = [r.combine for r in reports if r is not None and r.combine is not None]
        assert len(combined) == 12 and all(p.status == "ok" for r in combined for p in r.parts)  # 3 parts x 4 groups
    ref = _np_majority(stack.numpy())
    assert (ref >= 0).all() and np.array_equal(np.unpackbits(ops.majority_vote(stack, seed=5, step=3).numpy(),
                                                             bitorder="little"), ref)
    voted = [i for i in range(n) if i != partless]
    assert (_np_majority(stack[voted].numpy()) < 0).sum() > 100  # ties: a wrong tie offset flips about half


def _fail_its_own_group(node, *, then_everything: bool = False) -> None:
    """``node`` combines its part for the groups, then fails to answer its own group (a member leaving
    mid-round); ``then_everything``: and every answer after that (it left: nobody gets a slice from it)."""
    send_result, gone = node._send_result, []

    async def failing(writer, spec, part, outcome, report=None, **kwargs):
        if spec.combine or (then_everything and gone):  # its group's round (the second level has no combine)
            gone.append(True)
            raise ConnectionResetError("left mid-round")
        return await send_result(writer, spec, part, outcome, report, **kwargs)

    node._send_result = failing


@pytest.mark.slow
def test_a_group_whose_reducer_fails_after_combining_assembles_its_part_from_the_second_level():
    """The reducer of part k of one group combines (the other groups get part k from the second level)
    and then fails to answer its own group (a member leaving mid-round). Its group's voters fetch part
    k's second-level slices, each signed by the combiner that reduced it, and apply what every other
    group applies: all 13 updates equal, bit for bit. Before, that group applied nothing there, diverged
    as a whole and downloaded the state member by member."""
    from lioncub_p2p.testing import FAST_CONFIG, LocalSwarm

    n, nbytes = 13, 4096
    stack = _votes(n, nbytes, seed=22)
    with LocalSwarm(n, config=FAST_CONFIG) as swarm:
        ids = [p.peer_id for p in swarm.group]
        layout = hierarchy.two_level_layout(ids, 0, nbytes, max_size=4)
        group = next(g for g in layout.groups if len(g) == 3)
        failing = ids.index(group[1])  # reduces part 1 of its group, and combines part 1's round
        _fail_its_own_group(swarm.nodes[failing])
        results = swarm.two_level(list(stack), max_size=4, step=7, seed=5)
        reports = list(swarm.reports)
    members = [ids.index(pid) for pid in group if ids.index(pid) != failing]
    assert all(reports[i].parts[1].status == "recovered" and reports[i].parts[1].second_level for i in members)
    assert not any(p.second_level for i, r in enumerate(reports) if i not in members for p in r.parts)
    # who counted what, as the failing reducer saw it (its group's other reports have no header for part 1)
    expected = _two_level_expected(stack, layout, ids, [reports[failing] if ids[i] in group else r
                                                        for i, r in enumerate(reports)], seed=5, step=7)
    for i, result in enumerate(results):
        assert torch.equal(result, expected), i


@pytest.mark.slow
def test_members_of_other_groups_fetch_second_level_slices_as_members_not_strangers():
    """As in the test above, a reducer fails its group after combining (and then everything: it left),
    and every node admits no stranger streams at all, which stands for a combiner whose 16 stranger
    streams a large group's askers fill: the failed group's voters ask other groups' reducers for
    slices and get them because the swarm tells each node who is in the run (``VoteNode.in_run``); all
    13 updates equal. As strangers (the hook unset) they were refused and their group applied nothing there."""
    from lioncub_p2p.testing import FAST_CONFIG, LocalSwarm

    n, nbytes = 13, 4096
    stack = _votes(n, nbytes, seed=25)
    with LocalSwarm(n, config=dataclasses.replace(FAST_CONFIG, max_stranger_streams=0)) as swarm:
        ids = [p.peer_id for p in swarm.group]
        for node in swarm.nodes:
            node.in_run = set(ids).__contains__
        layout = hierarchy.two_level_layout(ids, 0, nbytes, max_size=4)
        group = next(g for g in layout.groups if len(g) == 3)
        _fail_its_own_group(swarm.nodes[ids.index(group[1])], then_everything=True)
        results = swarm.two_level(list(stack), max_size=4, step=8, seed=5)
        reports = list(swarm.reports)
    members = [ids.index(pid) for pid in group if pid != group[1]]
    assert all(reports[i].parts[1].second_level for i in members)
    assert all(torch.equal(r, results[0]) for r in results) and results[0].dtype == torch.uint8


@pytest.mark.slow
def test_a_group_below_its_quorum_for_a_part_applies_what_the_other_groups_decided_there():
    """Both voters of one group of 3 fail to reach its reducer of part 1 (below the quorum of 2): that
    group's votes are left out of part 1, which the other groups still decide at the second level. The
    reducer and its voters assemble part 1 from the second level's signed slices, so all 13 apply the
    same update, bit for bit. Before, the reducer applied nothing there (its own part was never
    recovered) while its voters applied the part: the group split."""
    from lioncub_p2p.testing import FAST_CONFIG, LocalSwarm

    n, nbytes = 13, 4096
    stack = _votes(n, nbytes, seed=23)
    with LocalSwarm(n, config=FAST_CONFIG) as swarm:
        ids = [p.peer_id for p in swarm.group]
        layout = hierarchy.two_level_layout(ids, 0, nbytes, max_size=4)
        q_short, group = next((q, g) for q, g in enumerate(layout.groups) if q > 0 and len(g) == 3)
        reducer = ids.index(group[1])
        voters = [ids.index(pid) for pid in group if pid != group[1]]
        for v in voters:
            node = swarm.nodes[v]

            async def cut_part_1(writer, state, j, upload, statement, send=node._send_votes):
                if state.spec.combine and j == 1:  # its group's round, part 1
                    raise ConnectionResetError("link down")
                return await send(writer, state, j, upload, statement)

            node._send_votes = cut_part_1
        results = swarm.two_level(list(stack), max_size=4, step=9, seed=5)
        reports = list(swarm.reports)
    combiners = reports[ids.index(layout.groups[0][1])].combine  # part 1's round as group 0's reducer saw it
    assert all(q_short not in p.counted and len(p.counted) == len(layout.groups) - 1 for p in combiners.parts)
    expected = _two_level_expected(stack, layout, ids, reports, seed=5, step=9)
    for i, result in enumerate(results):
        assert torch.equal(result, expected), i
    assert reports[reducer].parts[1].note.startswith("assembled from the second level")
    for i in [reducer, *voters]:
        assert reports[i].parts[1].status == "recovered" and reports[i].parts[1].second_level, i


@pytest.mark.slow
def test_a_group_of_two_with_a_member_gone_stops_waiting_for_it_after_three_rounds():
    """Groups of 2 (6 VoteNodes); one member's daemon dies. Its partner's part can never reach the
    quorum of 2 again: for three rounds it waits out the upload timeout (the member may be slow), then
    the member is late (``punctuality.py``) and the partner closes within a grace, every round, while
    its part still comes from the other groups at the second level. All survivors apply the same update
    every round. Before, every round waited the upload timeout until the member left the group."""
    import time

    from lioncub_p2p.testing import FAST_CONFIG, LocalSwarm

    n, nbytes = 6, 2048
    stack = _votes(n, nbytes, seed=24)
    with LocalSwarm(n, config=FAST_CONFIG) as swarm:
        ids = [p.peer_id for p in swarm.group]
        layout = hierarchy.two_level_layout(ids, 0, nbytes, max_size=2)
        gone, partner = ids.index(layout.groups[1][1]), ids.index(layout.groups[1][0])
        swarm.kill(gone)
        seconds, partner_parts = [], []
        for step in range(1, 6):
            started = time.perf_counter()
            results = swarm.two_level(list(stack), max_size=2, step=step, seed=5)
            seconds.append(time.perf_counter() - started)
            partner_parts.append(swarm.reports[partner].parts[0])
            survivors = [r for i, r in enumerate(results) if i != gone]
            assert all(torch.equal(r, survivors[0]) for r in survivors), step
    timeout = FAST_CONFIG.upload_timeout
    assert all(s > timeout for s in seconds[:3]), seconds  # waited for: it may only be slow
    assert all(s < 0.8 * timeout for s in seconds[3:]), seconds  # late three rounds in a row: not waited for
    assert all(p.status == "recovered" and p.second_level for p in partner_parts), partner_parts


@pytest.mark.slow
def test_a_reducer_that_sends_its_group_another_result_than_the_second_levels_is_caught_by_its_voters():
    """A voter cannot recount its group's first-level result (it is the second level's majority), but
    it compares a slice of it, chosen privately, with the same slice fetched signed by its combiner. A
    reducer that flips its part's bits for its own group (validly signed) is caught by those voters;
    in the honest round before, nobody is."""
    from lioncub_p2p.testing import flipped

    with _audited_two_level(seed=23) as (swarm, stack, ids, layout):  # groups of 3: both other parts compared
        group = next(g for g in layout.groups if len(g) == 3)
        liar = ids.index(group[2])
        swarm.two_level(list(stack), max_size=4, step=1, seed=5)
        swarm.settle_audits()
        assert not any(node.caught for node in swarm.nodes)  # honest: every comparison agrees

        def outcome_for(state, to, outcome):  # its own group's voters get every bit flipped, re-signed
            return flipped(outcome, swarm.nodes[liar].identity) if state.spec.combine else outcome

        swarm.nodes[liar]._outcome_for = outcome_for
        swarm.two_level(list(stack), max_size=4, step=2, seed=5)
        swarm.settle_audits()
        catchers = {i for i, node in enumerate(swarm.nodes) if node.caught}
        assert catchers == {ids.index(pid) for pid in group if pid != group[2]}
        assert all(set(swarm.nodes[i].caught) == {group[2]} and swarm.nodes[i].caught[group[2]].kind == "misrepresented"
                   for i in catchers)


def test_owed_margins_recounts_opened_votes_as_numpy_does_and_refuses_a_bad_opening():
    """``audit.owed_margins`` against numpy: the codes of 2c - v + s for a byte range of a part, from
    counted voters' leaves opened against the roots a reducer signed (what a group's voter holds its
    reducer to in a two-level vote); a code that does not open its root is no recount."""
    from lioncub_p2p.allreduce import PeerSpec, RoundSpec
    from lioncub_p2p.allreduce.audit import first_level_leaves, owed_margins
    from lioncub_p2p.allreduce.commit import MerkleTree, build_header, leaf_of, parse_header
    from lioncub_p2p.wire import WireError, pb

    n, bits = 7, 4
    spec = RoundSpec(b"r" * 16, 3, tuple(PeerSpec(f"p{i}") for i in range(n)), 7 * 4096)
    a, b = spec.bounds[0]
    votes = np.random.default_rng(31).integers(0, 256, (n, b - a), dtype=np.uint8)  # the voters' codes of part 0
    counted = [0, 1, 2, 4, 5, 6]  # voter 3 missed the round
    leaf = parse_header(build_header(spec, 0, counted, [b"x" * 16] * len(counted), b"", 0, b"")).leaf_bytes
    trees = {v: MerkleTree(votes[v][None, :], leaf) for v in counted}
    header = parse_header(build_header(spec, 0, counted, [trees[v].root for v in counted], b"", 0, b""))
    x, y = 2 * leaf + 8, 4 * leaf - 8  # straddles two leaves
    leaves = first_level_leaves(header, x, y)
    assert leaf >= 16 and leaves == [2, 3]
    openings = {k: [pb.AuditAnswer(leaf=k, voter=v, codes=leaf_of(votes[v][None, :], leaf, k), path=trees[v].path(k))
                    for v in counted] for k in leaves}
    got = owed_margins(header, openings, bits, x, y)
    c = np.unpackbits(votes[counted][:, x:y], axis=1, bitorder="little").sum(axis=0).astype(np.int64)
    margin = 2 * c - len(counted) + (1 << (bits - 1)) - 1
    want = np.stack([np.packbits((margin >> b) & 1, bitorder="little") for b in range(bits)])
    assert got == want.tobytes()
    openings[3][1].codes = bytes([openings[3][1].codes[0] ^ 1]) + openings[3][1].codes[1:]
    with pytest.raises(WireError, match="do not open"):
        owed_margins(header, openings, bits, x, y)


def test_a_margins_proof_convicts_margins_other_than_the_signed_votes_and_never_honest_ones(tmp_path):
    """``audit.check_evidence`` with a ``MarginsProof``: a reducer's signed group-round header (its votes'
    roots, the second level's slices and bits), its signed statement of a slice's margins, one margin
    leaf and its group's votes under it. Margins from numpy's 2c - v + s prove nothing; margins that
    differ prove a lie of exactly that reducer, round and part; a proof whose pieces do not tie
    together (another group, a statement not the reducer's) proves nothing, nor does a plain recount
    of the group's votes against the result it signed (the second level's majority)."""
    from lioncub_p2p.allreduce.audit import check_evidence, first_level_leaves
    from lioncub_p2p.allreduce.commit import (MerkleTree, build_header, leaf_bytes, leaf_of, parse_header,
                                              result_signed_bytes, statement_signed_bytes)
    from lioncub_p2p.identity import Identity
    from lioncub_p2p.wire import PROTOCOL_VERSION, pb

    reducer, other = Identity.load_or_create(tmp_path / "r.key"), Identity.load_or_create(tmp_path / "o.key")
    ids = [reducer.peer_id] + [f"peer{i}" for i in range(8)]
    nbytes, flat = 3 * 2048, b"f" * 16
    layout = hierarchy.two_level_layout(ids, 0, nbytes, max_size=3)
    spec = hierarchy.two_level_specs(flat, 9, layout, nbytes)[reducer.peer_id]
    j = [m.peer_id for m in spec.group].index(reducer.peer_id)
    combine, (a, b) = spec.combine[j], spec.bounds[j]
    bits, v = combine.upload.bits, len(spec.group)
    votes = np.random.default_rng(5).integers(0, 256, (v, b - a), dtype=np.uint8)  # its group's codes of part j
    leaf = leaf_bytes(b - a, 1)
    trees = [MerkleTree(votes[i][None, :], leaf) for i in range(v)]
    raw = build_header(spec, j, list(range(v)), [t.root for t in trees], b"", 0, b"result")
    header = parse_header(raw)
    assert (header.second_level_groups, header.margin_bits) == (len(combine.group), bits)
    c = np.unpackbits(votes, axis=1, bitorder="little").sum(axis=0).astype(np.int64)
    honest = 2 * c - v + (1 << (bits - 1)) - 1

    def evidence(margin: np.ndarray, *, q: int = 1, k: int = 2, group: int = spec.group_index,
                 signer: Identity = reducer) -> bytes:
        qa, qb = combine.bounds[q]
        codes = np.stack([np.packbits((margin[8 * qa:8 * qb] >> p) & 1, bitorder="little") for p in range(bits)])
        lb = leaf_bytes(qb - qa, bits)
        tree = MerkleTree(codes, lb)
        statement = pb.VoterStatement(root=tree.root, max_abs=0.0, public_key=signer.public_key,
                                      signature=signer.sign(statement_signed_bytes(combine.round_id, q, tree.root, 0.0)))
        x, y = qa + k * lb, min(qa + (k + 1) * lb, qb)
        opened = [pb.AuditAnswer(leaf=k1, voter=i, codes=leaf_of(votes[i][None, :], leaf, k1), path=trees[i].path(k1))
                  for k1 in first_level_leaves(header, x, y) for i in range(v)]
        proof = pb.MarginsProof(flat_round=flat, group=group, slice=q, statement=statement,
                                margins=pb.AuditAnswer(leaf=k, voter=0, codes=leaf_of(codes, lb, k), path=tree.path(k)))
        return pb.Evidence(version=PROTOCOL_VERSION, header=raw, signature=reducer.sign(result_signed_bytes(raw)),
                           public_key=reducer.public_key, wire=b"result", leaf=0, votes=opened,
                           margins=proof).SerializeToString()

    for q in range(len(combine.group)):  # honest margins, in every slice: nothing to prove
        assert check_evidence(evidence(honest, q=q, k=0)) is None
    lying = honest.copy()
    lying[:] = 2 * ((1 << (bits - 1)) - 1)  # every position all for
    got = check_evidence(evidence(lying))
    assert got is not None and got[:3] == (reducer.peer_id, spec.round_id, j) and "margins" in got[3], got
    assert check_evidence(evidence(lying, group=spec.group_index + 1)) is None  # another group's round id
    assert check_evidence(evidence(lying, signer=other)) is None  # a statement the reducer did not sign
    # the result a group round's reducer signs is the second level's majority: a plain recount of its
    # group's votes differs wherever other groups tipped the vote, and must prove nothing
    group_majority = np.packbits(2 * c > v, bitorder="little")
    tipped = group_majority.copy()
    tipped[:4] ^= 0xFF
    tipped_raw = build_header(spec, j, list(range(v)), [t.root for t in trees], b"", 0, tipped.tobytes())
    plain = pb.Evidence(version=PROTOCOL_VERSION, header=tipped_raw, signature=reducer.sign(result_signed_bytes(tipped_raw)),
                        public_key=reducer.public_key, wire=tipped.tobytes(), leaf=0,
                        votes=[pb.AuditAnswer(leaf=0, voter=i, codes=leaf_of(votes[i][None, :], leaf, 0),
                                              path=trees[i].path(0)) for i in range(v)]).SerializeToString()
    assert check_evidence(plain) is None
    one_off = honest.copy()
    one_off[8 * combine.bounds[1][0] + 8 * 2 * leaf_bytes(combine.bounds[1][1] - combine.bounds[1][0], bits)] += 2
    assert check_evidence(evidence(one_off)) is not None  # one margin off by one vote, in the opened leaf


@pytest.mark.slow
def test_a_reducer_that_sends_the_second_level_other_margins_than_its_groups_counts_is_caught_by_its_voters():
    """A group's reducer that votes other margins at the second level than its group's counts (here:
    every position all for), while it gives its group the second level's true result, passes the slice
    comparison; its group's voters open one margin leaf at the slice's combiner (signed by the reducer
    in its statement) and the votes behind it at the reducer, recount, and convict it with evidence
    anyone can check. In the honest round before, nobody is reported."""
    from lioncub_p2p.allreduce.audit import check_evidence
    with _audited_two_level(seed=25) as (swarm, stack, ids, layout):
        group = next(g for g in layout.groups if len(g) == 3)
        liar = swarm.nodes[ids.index(group[1])]
        swarm.two_level(list(stack), max_size=4, step=1, seed=5)
        swarm.settle_audits()
        assert not any(node.caught for node in swarm.nodes)  # honest margins: every recount agrees...
        assert sum(node.margins_checked for node in swarm.nodes) >= len(swarm.nodes)  # ...and there were recounts (2 per voter here)
        run_round = liar.run_round

        async def lying_run_round(spec, upload, tag=b"", **kwargs):
            if spec.second_level:  # margin +3: within what a group of 3 may say (more is refused outright)
                s = (1 << (spec.upload.bits - 1)) - 1
                upload = codecs.pack_planes(torch.full((8 * spec.nbytes,), s + len(group)), spec.upload.bits)
            return await run_round(spec, upload, tag, **kwargs)

        liar.run_round = lying_run_round
        swarm.two_level(list(stack), max_size=4, step=2, seed=5)
        swarm.settle_audits()
        catchers = {i for i, node in enumerate(swarm.nodes) if node.caught}
        assert catchers == {ids.index(pid) for pid in group if pid != group[1]}
        for i in catchers:  # a lie, with evidence that convicts exactly that reducer of that round and part
            caught = swarm.nodes[i].caught
            assert set(caught) == {group[1]} and caught[group[1]].kind == "lie" and "margins" in caught[group[1]].reason
            proved = check_evidence(caught[group[1]].evidence)
            assert proved is not None and proved[:3] == (group[1], caught[group[1]].round_id, caught[group[1]].part)


@pytest.mark.slow
def test_a_combiner_serving_auditors_another_slice_gets_no_honest_reducer_accused(caplog):
    """A combiner that signs a second version of its slice and serves it to auditors (not to the other
    combiners) would make every auditor of that part accuse its honest reducers. A mismatch is checked
    against a second copy from another combiner: two versions, no verdict."""
    import contextvars
    import random

    from lioncub_p2p.testing import flipped

    with _audited_two_level(seed=24) as (swarm, stack, ids, layout):
        forger = ids.index(layout.groups[0][1])  # combines part 1: slice 0 of part 1's round is its own
        node = swarm.nodes[forger]
        fetching = contextvars.ContextVar("fetching", default=False)  # copied into the tasks it starts
        check_asker, send_result = node._check_asker, node._send_result

        def note_fetch(spec, peer):  # only the fetch handler asks this
            fetching.set(True)
            return check_asker(spec, peer)

        async def forge_for_fetches(writer, spec, part, outcome, report=None, **kwargs):
            if fetching.get() and spec.round_id in node._second_level:
                outcome = flipped(outcome, node.identity)
            return await send_result(writer, spec, part, outcome, report, **kwargs)

        node._check_asker, node._send_result = note_fetch, forge_for_fetches

        class _ForgersSlice(random.Random):
            def randrange(self, *args):  # every comparison picks slice 0 (the forger's, in part 1's round)
                return 0

        for other in swarm.nodes:
            other.audit_rng = _ForgersSlice()
        with caplog.at_level("WARNING", logger="lioncub_p2p.allreduce.node"):
            swarm.two_level(list(stack), max_size=4, step=3, seed=5)
            swarm.settle_audits()
        assert not any(other.caught for other in swarm.nodes), [o.caught for o in swarm.nodes]
        assert any("came in two versions" in r.getMessage() for r in caplog.records)


def test_a_group_that_diverged_as_a_whole_is_told_by_the_second_level():
    """Each group's reducer votes its group's state tag at the second level; where most groups hold
    another state, its part's result carries that one, as if every counted voter had sent it."""
    from lioncub_p2p.allreduce.round import PartReport, RoundReport

    def combined(*tags_per_slice):  # one (tag -> groups) map per slice of the part
        parts = []
        for k, tags in enumerate(tags_per_slice):
            tag, votes = max(tags.items(), key=lambda kv: kv[1])
            parts.append(PartReport(k, k, 0, 1, "ok", counted=list(range(sum(tags.values()))), tag=tag, tag_votes=votes))
        return RoundReport("r", 0, 0, parts)

    three = combined({b"ok": 2, b"off": 1}, {b"ok": 2, b"off": 1})
    assert hierarchy.group_tag(b"off", 3, 3, three, 3) == (b"ok", 3)  # outvoted by the other groups: repair
    # the group holds the settled state by 1 of 2 votes (its other member diverged alone): said with every
    # vote, so that member repairs (1 of 2 decides nothing in its group's own parts)
    assert hierarchy.group_tag(b"ok", 1, 2, three, 3) == (b"ok", 2)
    two = combined({b"ok": 1}, {b"off": 1})  # each slice counted one group: no tag most slices name
    assert hierarchy.group_tag(b"off", 2, 2, two, 2) == (b"off", 2)
    missing = RoundReport("r", 0, 0, [PartReport(0, 0, 0, 1, "missing")])
    assert hierarchy.group_tag(b"off", 2, 2, missing, 2) == (b"off", 2)
    # no fallback across groups: three groups naming three states (two diverged ones sorting first) settle
    # on none, where every group counted would otherwise follow the smallest, a diverged one
    three_ways = RoundReport("r", 0, 0, [PartReport(k, k, 0, 1, "ok", counted=[0, 1, 2], tag=b"Z1", tag_votes=1)
                                         for k in range(2)])
    assert hierarchy.group_tag(b"ok", 2, 2, three_ways, 3) == (b"ok", 2)
    # a group votes up only a state most of its voters hold: a pair apart votes none, and so does a group
    # of 5 whose part counted a quorum of 3 with both of its diverged members in it
    assert hierarchy.decided_tag(b"Z", 1, [0, 1], [0, 1]) == b"" and hierarchy.decided_tag(b"ok", 2, [0, 1], [0, 1]) == b"ok"
    assert hierarchy.decided_tag(b"Z", 2, range(5), [0, 3, 4]) == b"" and hierarchy.decided_tag(b"ok", 3, range(5), [0, 1, 2]) == b"ok"
    assert hierarchy.decided_tag(b"Z", 1, [0], [0, 1]) == b""  # a follower counted in time counts against
    # the limit: pairs apart in two of three groups vote none, the third group's state is 1 of 3 groups,
    # so their diverged members are told nothing until the closing check
    abstaining = combined({b"ok": 1, b"": 2})
    assert hierarchy.group_tag(b"ok", 1, 2, abstaining, 3) == (b"ok", 1)


def test_pairs_split_one_to_one_never_make_the_swarm_follow_the_state_that_sorts_first():
    """6 VoteNodes over libp2p in 3 groups of 2; two groups hold one member each that diverged to a state
    whose tag sorts first. A pair split 1:1 names that tag (a tie by byte order) but decides nothing, so
    its reducer votes up none (``hierarchy.decided_tag``): no peer is told to hold it, where groups voting
    up their named tags made it 2 of 3 groups and the four peers holding the common state repaired."""
    from lioncub_p2p.testing import FAST_CONFIG, LocalSwarm

    honest, diverged, nbytes = b"\x7f" * 8, b"\x00" * 8, 1024
    with LocalSwarm(6, config=FAST_CONFIG) as swarm:
        ids = [p.peer_id for p in swarm.group]
        layout = hierarchy.two_level_layout(ids, 0, nbytes, max_size=2)
        apart = {ids.index(g[-1]) for g in layout.groups[:2]}  # one member of each of two pairs
        tags = [diverged if i in apart else honest for i in range(6)]
        results = swarm.two_level(list(_votes(6, nbytes, seed=3)), max_size=2, step=1, seed=2, tags=tags)
        assert all(r is not None for r in results)
        held = [report.tag_majority(range(2))[0] for report in swarm.reports]  # groups of 2 voters
    assert all(report.combine is not None for report in swarm.reports if any(p.reducer == report.peer
                                                                             for p in report.parts))
    assert diverged not in held, held  # nobody follows the state two of six hold
    whole = [i for i in range(6) if ids[i] in layout.groups[2]]
    assert all(held[i] == honest for i in whole), held  # the pair that agrees keeps its own


def test_a_groups_provisional_voters_are_named_alike_to_its_reducers_and_its_members():
    """A group whose own count stands (the second level decided nothing: two pairs split) names its
    provisional voters in the header it sends, as its reducer's own view does: a founder and its
    newcomer decide for their state (1 of 1) in every member's reading. Before, the header named none,
    and the newcomer read 1 of 2 where its reducer read 1 of 1. Where the second level decides, its tag
    counts as every voter's and names none. Break-check: without the list in the rebuilt header, the
    members' readings differ."""
    from lioncub_p2p.testing import FAST_CONFIG, LocalSwarm

    honest, nbytes = b"\x7f" * 8, 1024
    with LocalSwarm(6, config=FAST_CONFIG) as swarm:
        ids = [p.peer_id for p in swarm.group]
        layout = hierarchy.two_level_layout(ids, 0, nbytes, max_size=2)
        founder, newcomer = (ids.index(pid) for pid in layout.groups[0])
        split = {ids.index(g[-1]): bytes([k]) * 8 for k, g in enumerate(layout.groups[1:])}  # each pair 1:1
        tags = [split.get(i, honest) for i in range(6)]
        swarm.two_level(list(_votes(6, nbytes, seed=5)), max_size=2, step=1, seed=3, tags=tags, provisional=[newcomer])
        readings = {i: (swarm.reports[i].tag_majority(range(2))[0],
                        [p.provisional for p in swarm.reports[i].parts if p.status in ("ok", "recovered")])
                    for i in (founder, newcomer)}
        assert readings[founder] == readings[newcomer], readings
        assert readings[founder][0] == honest and all(p == [1] for p in readings[founder][1]), readings
        swarm.two_level(list(_votes(6, nbytes, seed=6)), max_size=2, step=2, seed=3, tags=[honest] * 6,
                        provisional=[newcomer])  # the second level decides: its tag is every voter's
        assert all(p.provisional == [] and r.tag_majority(range(2))[0] == honest
                   for r in (swarm.reports[founder], swarm.reports[newcomer]) for p in r.parts if p.status == "ok")


def test_a_second_level_voter_cannot_send_up_a_margin_past_its_groups_size():
    """Margin codes are sized by the largest group (4 members here: 4 bits, margins up to 7): a group of 3
    whose reducer sends margin 7 at chosen positions would outvote the other group's honest -4 there.
    The combiner refuses margins past the sender's group size, and counts honest ones at the cap."""
    import asyncio

    from lioncub_p2p.allreduce.reducer import PartReduction
    from lioncub_p2p.wire import WireError

    ids = [f"peer{i}" for i in range(7)]
    layout = hierarchy.two_level_layout(ids, 0, 64, max_size=4)
    sizes = [len(g) for g in layout.groups]
    assert sorted(sizes) == [3, 4]
    combine = hierarchy.two_level_specs(b"r", 1, layout, 64)[ids[0]].combine[0]
    assert combine.margin_caps == tuple(sizes)
    s = combine.upload.scale_steps
    small = sizes.index(3)
    nbytes = combine.bounds[0][1] - combine.bounds[0][0]

    def margins(value: int) -> torch.Tensor:
        return codecs.pack_planes(torch.full((8 * nbytes,), value + s), combine.upload.bits)

    async def scenario():
        red = PartReduction(combine, 0)
        red.add(small, 0, margins(3), last=True)  # its whole group for: the most it can honestly say
        with pytest.raises(WireError, match="a margin of 7 from a group of 3"):
            PartReduction(combine, 0).add(small, 0, margins(7), last=True)
        with pytest.raises(WireError, match="a margin of 4 from a group of 3"):
            PartReduction(combine, 0).add(small, 0, margins(-4), last=True)
        PartReduction(combine, 0).add(1 - small, 0, margins(-4), last=True)  # the group of 4 may

    asyncio.run(scenario())
