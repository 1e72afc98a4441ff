"""Swarm pieces: membership records, snapshots, checkpoints, state transfer, repair, restart."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from hivemind.p2p import P2P
from torch import nn

from lioncub_p2p import LionCub, MomentumSchedule
from lioncub_p2p.aio import BackgroundLoop
from lioncub_p2p.allreduce import AllReduceConfig, PeerSpec
from lioncub_p2p.sim.tasks import digits_task
from lioncub_p2p.swarm import Swarm, SwarmConfig, checkpoint, snapshot
from lioncub_p2p.swarm import state_transfer
from lioncub_p2p.identity import Identity
from lioncub_p2p.swarm import AdmissionRefused
from lioncub_p2p.swarm.membership import GroupHistory, GroupRecord, PeerRecord
from lioncub_p2p.swarm.records import RecordError, seal
from lioncub_p2p.wire import PROTOCOL_VERSION


# -- membership records (pure; signed-record checks and attacks are in test_membership.py) ------------

def test_peer_record_round_trip_and_garbage():
    ident = Identity.load_or_create(None)
    record = PeerRecord(ident.peer_id, 2.0, True, 7, PROTOCOL_VERSION, True, 10.0, 1.0, 2.0, 0.5, manifest="ab")
    value = seal(ident, "run", "peers", 99.0, record.payload())
    parsed = PeerRecord.parse(ident.peer_id, value, 99.0, run_id="run")
    assert parsed == PeerRecord(**{**record.__dict__, "expires": 99.0})
    assert PeerRecord.parse(ident.peer_id, value, 99.0) == parsed  # a monitor reads the run the record names
    assert PeerRecord.parse(ident.peer_id, value, 99.0, run_id="other") is None  # not replayable into another run
    assert PeerRecord.parse("someone-else", value, 99.0, run_id="run") is None  # nor under another subkey
    assert PeerRecord.parse(ident.peer_id, value, 100.0, run_id="run") is None  # nor with another expiration
    for bad in ({"weight": "x"}, {**record.payload(), "weight": -1.0}, {**record.payload(), "weight": 1e7},
                {**record.payload(), "step": 1 << 62}, {**record.payload(), "step": 1.5},
                {**record.payload(), "synced": 1}, {**record.payload(), "manifest": "x" * 100}):
        assert PeerRecord.parse(ident.peer_id, seal(ident, "run", "peers", 99.0, bad), 99.0, run_id="run") is None, bad
    for garbage in ([1, 2], None, {"r": "run"}, {**value, "p": b"x" * 10_000}, {**value, "k": 12}):
        assert PeerRecord.parse(ident.peer_id, garbage, 99.0, run_id="run") is None
    assert PeerRecord.parse(123, value, 99.0, run_id="run") is None


def test_group_record_parse_rejects_malformed():
    g = GroupRecord(3, 40, (PeerSpec("a"), PeerSpec("b", 2.0), PeerSpec("c", 1.0, True)),
                    previous=GroupRecord(2, 10, (PeerSpec("a"),)))
    parsed = GroupRecord.from_payload(g.payload(), "a")
    assert parsed == g and parsed.previous == g.previous and parsed.author == "a"
    value = g.payload()
    for broken in ({**value, "members": []}, {**value, "members": [["a", 1.0, False], ["a", 1.0, False]]},
                   {**value, "members": [["a", 1.0, True]]}, {**value, "epoch": "x"}, "garbage",
                   {**value, "members": [["a", float("inf"), False]]}, {**value, "members": [["a", 1e9, False]]},
                   {**value, "from_step": 1 << 62}, {**value, "previous": {**value["previous"], "epoch": 7}},
                   {**value, "members": [["a", 1.0]]}, {**value, "members": [["a" * 500, 1.0, False]]}):
        with pytest.raises(RecordError):
            GroupRecord.from_payload(broken, "a")


def test_group_history_picks_the_group_of_a_step():
    history = GroupHistory()
    first = GroupRecord(0, 0, (PeerSpec("a"),))
    second = GroupRecord(1, 12, (PeerSpec("a"), PeerSpec("b")), previous=first)
    history.add(second)  # the previous group arrives nested in the newest record
    assert history.for_step(5) == first and history.for_step(12) == second and history.for_step(100) == second
    assert history.latest == second and history.for_step(-1) is None


# -- snapshots and checkpoints ------------------------------------------------------------------------

def _opt(seed=0, hidden=16):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, hidden), nn.ReLU(), nn.Linear(hidden, 3))
    opt = LionCub(model.named_parameters(), lr=1e-2)
    for _ in range(3):
        nn.functional.cross_entropy(model(torch.randn(4, 5)), torch.tensor([0, 1, 2, 0])).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_snapshot_round_trip_and_rejections():
    _, src = _opt(0)
    _, dst = _opt(1)
    blob, digest = snapshot.encode(src)
    assert snapshot.load(dst, blob, expect_digest=digest) == 3
    for (_, a), (_, b) in zip(src.momentum_buffers(), dst.momentum_buffers()):
        assert torch.equal(a, b)
    assert snapshot.params_digest(dst) == digest
    assert snapshot.step_and_params_digest(blob) == (3, digest)  # no model needed (simulator, reports)
    with pytest.raises(snapshot.SnapshotError, match="truncated"):
        snapshot.step_and_params_digest(blob[: len(blob) // 4])
    _, other_shape = _opt(0, hidden=17)
    before = [p.clone() for p in (s.param for s in other_shape.slots)]
    with pytest.raises(snapshot.SnapshotError, match="do not match"):
        snapshot.load(other_shape, blob)
    assert all(torch.equal(a, s.param) for a, s in zip(before, other_shape.slots))  # untouched
    with pytest.raises(snapshot.SnapshotError):
        snapshot.load(dst, blob[:-1])
    with pytest.raises(snapshot.SnapshotError, match="digest"):
        snapshot.load(dst, blob, expect_digest=b"x" * 16)
    with pytest.raises(snapshot.SnapshotError, match="not a lioncub"):
        snapshot.load(dst, b"\x80\x04pickle")


def test_checkpoint_is_atomic_and_restores(tmp_path):
    _, src = _opt(0)
    path = checkpoint.save(tmp_path, src)
    assert path.exists() and not list(tmp_path.glob(".*.tmp"))
    _, dst = _opt(5)
    assert checkpoint.restore(tmp_path, dst) == 3
    assert snapshot.params_digest(dst) == snapshot.params_digest(src)
    assert checkpoint.restore(tmp_path / "missing", dst) is None


# -- state transfer between real daemons ---------------------------------------------------------------

class _DyingServer(state_transfer.StateServer):
    """Serves two chunks of each download, then drops the stream (a donor that dies mid-transfer)."""

    async def _on_stream(self, info, reader, writer):
        original = writer.write
        sent = {"n": 0}

        def write(data):
            sent["n"] += 1
            if sent["n"] > 4:  # header+body of two frames
                writer.close()
                raise ConnectionResetError("donor died")
            original(data)

        writer.write = write
        await super()._on_stream(info, reader, writer)


class _RecordingServer(state_transfer.StateServer):
    offsets: list[int]

    async def _on_stream(self, info, reader, writer):
        async def read_and_record(*a, **k):
            msg, n = await original(*a, **k)
            if msg is not None:
                self.offsets.append(msg.offset)
            return msg, n

        original = state_transfer.read_frame
        state_transfer.read_frame = read_and_record
        try:
            await super()._on_stream(info, reader, writer)
        finally:
            state_transfer.read_frame = original


async def _p2p_peers(n: int) -> list[P2P]:
    peers = []
    for _ in range(n):
        init = [str(m) for p in peers for m in await p.get_visible_maddrs()]
        peers.append(await P2P.create(initial_peers=init, nat_port_map=False, auto_nat=False))
    return peers


def _close_peers(loop: BackgroundLoop, peers: list[P2P]) -> None:
    async def shutdown():
        await asyncio.gather(*(p.shutdown() for p in peers))

    loop.run(shutdown(), timeout=30)
    loop.stop()


def test_download_resumes_from_another_donor_and_respects_busy(monkeypatch):
    monkeypatch.setattr(state_transfer, "CHUNK_BYTES", 4096)
    _, donor_opt = _opt(0, hidden=512)
    blob, digest = snapshot.encode(donor_opt)
    loop = BackgroundLoop()

    async def setup():
        peers = await _p2p_peers(3)
        dying = _DyingServer(peers[0], "run")
        recording = _RecordingServer(peers[1], "run", max_uploads=1)
        recording.offsets = []
        for server in (dying, recording):
            await server.start()
            await server.offer(3, blob, digest)
        return peers, dying, recording

    peers, dying, recording = loop.run(setup(), timeout=60)
    try:
        donors = [peers[0].peer_id.to_base58(), peers[1].peer_id.to_base58()]
        step, got, got_digest = loop.run(state_transfer.download_state(
            peers[2], donors, "run", min_step=3, max_bytes=len(blob) + 10), timeout=60)
        assert (step, got, got_digest) == (3, blob, digest)
        assert recording.offsets and recording.offsets[0] > 0  # resumed where the dying donor stopped
        with pytest.raises(state_transfer.StateTransferError):  # a step nobody has reached in time
            recording.wait_timeout = dying.wait_timeout = 0.5
            loop.run(state_transfer.download_state(peers[2], donors, "run", min_step=50, max_bytes=len(blob) + 10,
                                                   attempts=1), timeout=60)
    finally:
        _close_peers(loop, peers)


def test_download_starts_over_when_the_next_donor_moved_on(monkeypatch):
    """A training swarm does not wait for a newcomer: the donor it resumes from may be a step further.
    That donor sends its own snapshot from byte 0 and the newcomer ends with it, whole and consistent."""
    monkeypatch.setattr(state_transfer, "CHUNK_BYTES", 4096)
    _, old_opt = _opt(0, hidden=512)
    _, new_opt = _opt(1, hidden=512)
    (old_blob, old_digest), (new_blob, new_digest) = snapshot.encode(old_opt), snapshot.encode(new_opt)
    loop = BackgroundLoop()

    async def setup():
        peers = await _p2p_peers(3)
        dying, moved_on = _DyingServer(peers[0], "run"), _RecordingServer(peers[1], "run")
        moved_on.offsets = []
        for server, (step, blob, digest) in ((dying, (3, old_blob, old_digest)), (moved_on, (4, new_blob, new_digest))):
            await server.start()
            await server.offer(step, blob, digest)
        return peers, moved_on

    peers, moved_on = loop.run(setup(), timeout=60)
    try:
        donors = [peers[0].peer_id.to_base58(), peers[1].peer_id.to_base58()]  # tried in this order
        got = loop.run(state_transfer.download_state(peers[2], donors, "run", min_step=3,
                                                     max_bytes=len(new_blob) + 10), timeout=60)
        assert got == (4, new_blob, new_digest)
        assert moved_on.offsets[0] > 0  # the newcomer asked to resume; the donor started over
        restored = _opt(2, hidden=512)[1]
        snapshot.load(restored, got[1], expect_digest=got[2])
        assert snapshot.params_digest(restored) == snapshot.params_digest(new_opt)
    finally:
        _close_peers(loop, peers)


# -- a swarm in threads: repair and restart ---------------------------------------------------------------

FAST = AllReduceConfig(upload_timeout=2, result_timeout=4, join_timeout=2, recovery_timeout=1)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _config(run_id: str, **kwargs) -> SwarmConfig:
    """A swarm member on loopback with short round timeouts."""
    return SwarmConfig(run_id, **{"host_maddrs": LOOPBACK, "allreduce": FAST, **kwargs})


def _train_swarm(configs, steps, *, perturb=None, hidden=64):
    """Run one Swarm per config in its own thread until the global step reaches ``steps``."""
    task = digits_task(0, hidden=hidden)
    first = Swarm(configs[0])
    maddrs = [str(m) for m in first.dht.get_visible_maddrs()]
    swarms = [first] + [Swarm(c.__class__(**{**c.__dict__, "initial_peers": maddrs})) for c in configs[1:]]
    out, errors = {}, []

    def run(i, swarm):
        try:
            model = task.make_model(seed=i)
            opt = LionCub(model.parameters(), lr=1e-3, weight_decay=0.1, aggregator=swarm)
            out.setdefault("start", {})[i] = swarm.join(opt)
            swarm.wait_for_peers(len(swarms), timeout=60)  # start together: repairs then count only faults
            x, y = task.shard(i, len(swarms))
            gen = torch.Generator().manual_seed(i)
            repairs_before = 0  # repairs counted from the perturbed step on (a start-up race may repair once)
            while opt.step_count < steps:
                if perturb and opt.step_count == perturb[1]:
                    repairs_before = swarm.repairs
                    if perturb[0] == i:
                        with torch.no_grad():
                            next(model.parameters()).add_(1e-3)  # a bit flip's worth of divergence
                idx = torch.randint(0, len(x), (32,), generator=gen)
                nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
                opt.zero_grad()
                time.sleep(0.02)
            out[i] = (opt.step_count, snapshot.params_digest(opt), swarm.repairs - repairs_before)
        except Exception as e:  # surfaced by the assertions below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate(swarms)]
    try:
        for t in threads:
            t.start()
            time.sleep(0.3)
        for t in threads:
            t.join(120)
    finally:
        for s in swarms:
            s.shutdown()
    assert not errors, errors
    return out


def test_diverged_peer_repairs_itself_within_a_round():
    configs = [_config("repair", momentum=MomentumSchedule(every=5)) for _ in range(3)]
    out = _train_swarm(configs, 30, perturb=(2, 15))
    assert {out[i][0] for i in range(3)} == {30}
    assert len({out[i][1] for i in range(3)}) == 1  # identical parameters at the end
    assert out[2][2] >= 1 and out[0][2] == out[1][2] == 0  # only the diverged peer repaired (after step 15)


def test_swarm_restarts_from_checkpoints(tmp_path):
    def configs():
        return [_config("restart", checkpoint_dir=str(tmp_path / f"p{i}"), checkpoint_every=5)
                for i in range(2)]

    first = _train_swarm(configs(), 10)
    assert first[0][1] == first[1][1]
    second = _train_swarm(configs(), 15)  # new processes' worth of state: DHTs, daemons, models
    assert second["start"][0] >= 10  # the founder resumed its checkpoint instead of step 0
    assert second[0][1] == second[1][1] and second[0][0] == 15


def test_state_tag_samples_and_full_digest_differ_only_in_coverage():
    _, opt = _opt(0, hidden=300)  # more elements than one sample per slot: strided views of 1 element too
    sampled, full = snapshot.state_tag(opt, samples=7), snapshot.state_tag(opt, full=True)
    assert len(sampled) == len(full) == 16 and full == snapshot.params_digest(opt)
    with torch.no_grad():
        opt.slots[0].param.view(-1)[0] += 1.0  # an element every sample includes (index 0)
    assert snapshot.state_tag(opt, samples=7) != sampled and snapshot.state_tag(opt, full=True) != full


def test_run_secret_keeps_outsiders_out():
    secret = dict(run_secret="s3cret", join_timeout=8.0)
    out = _train_swarm([_config("admit", **secret), _config("admit", **secret)], 12)
    assert out[0][1] == out[1][1]
    # an outsider with the wrong secret, or none, is refused by the group's leader within one exchange:
    # it stops at once with one line, before building anything (no waiting for a group that never comes)
    task = digits_task(0, hidden=64)
    first = Swarm(_config("admit2", **secret))
    try:
        first.join(LionCub(task.make_model(0).named_parameters(), aggregator=first))
        for outsider_secret, expected in (("wrong", "refused this peer: wrong or missing run secret"), (None, "is private: pass its --run-secret")):
            started = time.monotonic()
            with pytest.raises(AdmissionRefused, match=expected) as refused:
                Swarm(_config("admit2", initial_peers=first.visible_maddrs(), run_secret=outsider_secret))
            assert time.monotonic() - started < 10.0 and "\n" not in str(refused.value)
            assert "--run-secret" in str(refused.value)
        assert first.history.latest.member_ids() == [first.peer_id]
    finally:
        first.shutdown()


def test_short_soak_with_churn_ends_identical():
    from lioncub_p2p.sim.soak import run_soak

    report = run_soak(90, peers=4, seed=3, fault_every=20, timeout=400)
    assert not report.errors, report
    assert report.rounds == 90 and sum(report.faults.values()) >= 3, report  # faults at steps 20, 40, 60
    assert report.identical_at_end and report.unrepaired == 0 and report.peers_at_end >= 3, report


def test_admission_tokens_and_allow_list():
    from lioncub_p2p.allreduce.admission import Admission

    secret = Admission("run", b"k")
    token = secret.token("peerA")
    assert secret.admits("peerA", token) and not secret.admits("peerB", token)  # bound to the peer id
    assert not Admission("run", b"other").admits("peerA", token)
    assert not Admission("run2", b"k").admits("peerA", token)  # and to the run
    assert secret.reason("peerA", b"") == "wrong or missing run secret"
    listed = Admission("run", None, frozenset({"peerA"}))
    assert listed.admits("peerA", b"") and listed.reason("peerB", b"") == "not on the run's allow-list"
    assert Admission().admits("anyone", b"") and Admission().token("x") == b""
    n, m = b"n" * 32, b"m" * 32
    proof = secret.proof("newcomer", "peerA", "peerB", n, m)
    assert secret.checks_proof(proof, "newcomer", "peerA", "peerB", n, m)
    for changed in (("member", "peerA", "peerB", n, m), ("newcomer", "peerC", "peerB", n, m),
                    ("newcomer", "peerA", "peerC", n, m), ("newcomer", "peerA", "peerB", m, m),
                    ("newcomer", "peerA", "peerB", n, n)):  # role, both ids and both nonces are bound in
        assert not secret.checks_proof(proof, *changed)
    assert not Admission("run", b"other").checks_proof(proof, "newcomer", "peerA", "peerB", n, m)
