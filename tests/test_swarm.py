"""Swarm pieces: membership records, snapshots, checkpoints, state transfer, repair, restart."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import struct
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hivemind.p2p import P2P
from torch import nn

from lioncub_p2p import LionCub, MomentumSchedule, codecs
from lioncub_p2p.aio import BackgroundLoop
from lioncub_p2p.allreduce import PeerSpec, hierarchy
from lioncub_p2p.testing import SWARM_ROUNDS
from lioncub_p2p.tasks.digits import digits_task
from lioncub_p2p.swarm import Swarm, SwarmConfig, checkpoint, snapshot
from lioncub_p2p.swarm import state_transfer
from lioncub_p2p.identity import Identity
from lioncub_p2p.swarm import AdmissionRefused, SwarmError
from lioncub_p2p.swarm.membership import GroupHistory, GroupRecord, PeerRecord
from lioncub_p2p.swarm.records import RecordError, seal
from lioncub_p2p.wire import PROTOCOL_VERSION, pb, write_frame

from reference import from_fp8_blocks, fp8_blocks


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
    g = GroupRecord(3, 40, (PeerSpec("a"), PeerSpec("b", 2.0), PeerSpec("c", 1.0, True), PeerSpec("d", 0.0, voter=False)),
                    previous=GroupRecord(2, 10, (PeerSpec("a"),)))
    parsed = GroupRecord.from_payload(g.payload(), "a")
    assert parsed == g and parsed.previous == g.previous and parsed.author == "a"
    assert [m.voter for m in parsed.members] == [True, True, True, False]
    value = g.payload()
    assert GroupRecord.from_payload({**value, "members": [["a", 1.0, False]]}, "a").members[0].voter  # 3 fields: a voter
    for broken in ({**value, "members": []}, {**value, "members": [["a", 1.0, False], ["a", 1.0, False]]},
                   {**value, "members": [["a", 1.0, True]]}, {**value, "epoch": "x"}, "garbage",
                   {**value, "members": [["a", float("inf"), False]]}, {**value, "members": [["a", 1e9, False]]},
                   {**value, "from_step": 1 << 62}, {**value, "previous": {**value["previous"], "epoch": 7}},
                   {**value, "members": [["a", 1.0]]}, {**value, "members": [["a" * 500, 1.0, False]]},
                   {**value, "members": [["a", 1.0, False, "yes"]]}, {**value, "members": [["a", 1.0, False, True, 1]]}):
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


def test_a_snapshot_without_momenta_loads_the_parameters_and_keeps_the_peers_own_momenta():
    """A repair or a skip ahead keeps the peer's own momenta (each peer's own; only the parameters must
    be the group's): half the bytes, the same step and digest."""
    _, src = _opt(0)
    _, dst = _opt(1)
    full, digest = snapshot.encode(src)
    lean = snapshot.without_momenta(full)
    momentum_bytes = sum(m.numel() * m.element_size() for _, m in src.momentum_buffers())
    header_growth = snapshot.read_header(lean)[1] - snapshot.read_header(full)[1]  # its "momenta": false
    assert len(lean) == len(full) - momentum_bytes + header_growth and 0 < header_growth < 32
    assert snapshot.step_and_params_digest(lean) == (3, digest)
    own = [m.clone() for _, m in dst.momentum_buffers()]
    assert snapshot.load(dst, lean, expect_digest=digest) == 3
    assert snapshot.params_digest(dst) == digest
    assert all(torch.equal(a, s.param) for a, s in zip((s.param for s in src.slots), dst.slots))
    assert all(torch.equal(a, m) for a, (_, m) in zip(own, dst.momentum_buffers()))  # its own, untouched
    assert not all(torch.equal(a, m) for (_, a), (_, m) in zip(src.momentum_buffers(), dst.momentum_buffers()))
    assert snapshot.without_momenta(lean) == lean
    with pytest.raises(snapshot.SnapshotError, match="snapshot body"):  # momenta cut off, header not saying so
        snapshot.load(dst, full[: len(full) - momentum_bytes])
    header, offset = snapshot.read_header(lean)
    forged = snapshot.MAGIC + struct.pack("<I", len(h := json.dumps(dict(header, momenta="no")).encode())) + h + \
        lean[offset:]
    with pytest.raises(snapshot.SnapshotError, match="momenta must be true or false"):
        snapshot.load(dst, forged)


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


def _failing_then_recording_donor(monkeypatch, failing: type, *, hidden: int = 512,
                                  **recording_kwargs) -> SimpleNamespace:
    """4 KiB chunks, the snapshot of a model ``hidden`` wide at step 3, and three daemons: peer 0 serves
    it through ``failing``, peer 1 through a ``_RecordingServer`` (the offsets it was asked to resume
    at); peer 2 downloads. Returns loop, peers, first, recording, blob, digest and donors (0, then 1)."""
    monkeypatch.setattr(state_transfer, "CHUNK_BYTES", 4096)
    _, donor_opt = _opt(0, hidden=hidden)
    blob, digest = snapshot.encode(donor_opt)
    loop = BackgroundLoop()

    async def setup():
        peers = await _p2p_peers(3)
        first = failing(peers[0], "run")
        recording = _RecordingServer(peers[1], "run", **recording_kwargs)
        recording.offsets = []
        for server in (first, recording):
            await server.start()
            await server.offer(3, blob, digest)
        return peers, first, recording

    peers, first, recording = loop.run(setup(), timeout=60)
    return SimpleNamespace(loop=loop, peers=peers, first=first, recording=recording, blob=blob, digest=digest,
                           donors=[peers[0].peer_id.to_base58(), peers[1].peer_id.to_base58()])


def test_download_resumes_from_another_donor(monkeypatch):
    t = _failing_then_recording_donor(monkeypatch, _DyingServer, max_uploads=1)
    try:
        step, got, got_digest = t.loop.run(state_transfer.download_state(
            t.peers[2], t.donors, "run", min_step=3, max_bytes=len(t.blob) + 10), timeout=60)
        assert (step, got, got_digest) == (3, t.blob, t.digest)
        assert t.recording.offsets and t.recording.offsets[0] > 0  # resumed where the dying donor stopped
        with pytest.raises(state_transfer.StateTransferError):  # a step nobody has reached in time
            t.recording.wait_timeout = t.first.wait_timeout = 0.5
            t.loop.run(state_transfer.download_state(t.peers[2], t.donors, "run", min_step=50,
                                                     max_bytes=len(t.blob) + 10, attempts=1), timeout=60)
    finally:
        _close_peers(t.loop, t.peers)


def test_a_download_without_momenta_resumes_from_another_donor(monkeypatch):
    """``params_only``: both donors cut the same lean snapshot from their full one, so a download cut
    at the first resumes at the second; it is the full snapshot without the momentum section."""
    t = _failing_then_recording_donor(monkeypatch, _DyingServer, hidden=1024, max_uploads=1)
    lean = snapshot.without_momenta(t.blob)
    try:
        step, got, got_digest = t.loop.run(state_transfer.download_state(
            t.peers[2], t.donors, "run", min_step=3, max_bytes=len(t.blob) + 10, params_only=True), timeout=60)
        assert (step, got_digest) == (3, t.digest) and got == lean and len(lean) < 0.55 * len(t.blob)
        assert t.recording.offsets and t.recording.offsets[0] > 0  # resumed where the dying donor stopped
    finally:
        _close_peers(t.loop, t.peers)


class _DyingOnceServer(_DyingServer):
    """Drops its first download after two chunks (a stream cut), then serves as usual."""

    async def _on_stream(self, info, reader, writer):
        if getattr(self, "died", False):
            return await state_transfer.StateServer._on_stream(self, info, reader, writer)
        self.died = True
        await super()._on_stream(info, reader, writer)


def test_a_cut_download_resumes_at_the_same_donor_before_one_that_moved_on(monkeypatch):
    """A stream cut mid-transfer (seen on a 1 Mbit/s link after 1 MB) is resumed at the donor that sent
    it, which still holds that snapshot; the next donor had moved on to a newer one, and resuming there
    started the download over."""
    t = _failing_then_recording_donor(monkeypatch, _DyingOnceServer, max_uploads=1)
    try:
        _, newer = _opt(1, hidden=512)
        t.loop.run(t.recording.offer(4, *snapshot.encode(newer)), timeout=10)  # the next donor moved on
        step, got, got_digest = t.loop.run(state_transfer.download_state(
            t.peers[2], t.donors, "run", min_step=3, max_bytes=2 * len(t.blob)), timeout=60)
        assert (step, got, got_digest) == (3, t.blob, t.digest)
        assert t.recording.offsets == []  # never asked: the cut donor resumed its own snapshot
    finally:
        _close_peers(t.loop, t.peers)


class _StallingServer(state_transfer.StateServer):
    """Sends the first two chunks of each download, then nothing more for a minute (a donor stalled
    mid-transfer, its stream open)."""

    async def _send(self, writer, req, step, blob, digest):
        size = state_transfer.CHUNK_BYTES
        for offset in (0, size):
            await write_frame(writer, pb.StateChunk(version=PROTOCOL_VERSION, step=step, total_bytes=len(blob),
                                                    offset=offset, data=blob[offset:offset + size], params_digest=digest))
        await asyncio.sleep(60)


def test_a_download_leaves_a_stalled_donor_for_the_next_and_its_bound_grows_with_the_state(monkeypatch):
    """A donor that stops sending mid-transfer is left after ``STALL_S`` without a chunk and the download
    resumes at the next donor (not after the whole bound: a slow link's bound is minutes). The bound is
    the wait plus the snapshot at 1 Mbit/s: a 22 MB state at 1 Mbit/s needs 176 s, which a fixed 120 s
    bound never gave it."""
    monkeypatch.setattr(state_transfer, "STALL_S", 1.0)
    assert state_transfer.download_bound(22_000_000, 120.0) == pytest.approx(120.0 + 176.0)
    t = _failing_then_recording_donor(monkeypatch, _StallingServer)
    try:
        started = time.monotonic()
        got = t.loop.run(state_transfer.download_state(t.peers[2], t.donors, "run", min_step=3,
                                                       max_bytes=len(t.blob) + 10, timeout=60), timeout=70)
        assert got == (3, t.blob, t.digest)
        assert t.recording.offsets and t.recording.offsets[0] > 0  # resumed where the stalled donor stopped
        assert time.monotonic() - started < 15  # left after ~1 s of silence, not at the 60 s bound
    finally:
        _close_peers(t.loop, t.peers)


class _CountingServer(state_transfer.StateServer):
    """Counts the downloads it took on (past the admission and busy checks)."""

    served = 0

    async def _wait_snapshot(self, min_step, fresh=False):
        self.served += 1
        return await super()._wait_snapshot(min_step, fresh)


def test_a_busy_donor_sends_a_newcomer_to_the_next_donor(caplog):
    """Donor A takes one download at a time. While it holds one (waiting for the step asked for),
    a second newcomer is told "busy" by A and downloads from B instead; the first still completes."""
    _, donor_opt = _opt(0, hidden=64)
    blob, digest = snapshot.encode(donor_opt)
    loop = BackgroundLoop()

    async def setup():
        peers = await _p2p_peers(4)
        busy, free = _CountingServer(peers[0], "run", max_uploads=1), _CountingServer(peers[1], "run")
        await busy.start()
        await free.start()
        await free.offer(5, blob, digest)  # A has no snapshot of step 5 yet: its one download waits
        return peers, busy, free

    peers, busy, free = loop.run(setup(), timeout=60)
    try:
        a, b = peers[0].peer_id.to_base58(), peers[1].peer_id.to_base58()
        first = asyncio.run_coroutine_threadsafe(state_transfer.download_state(
            peers[2], [a], "run", min_step=5, max_bytes=len(blob) + 10, attempts=1), loop.loop)
        deadline = time.monotonic() + 20
        while busy._uploads < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert busy._uploads == 1
        with caplog.at_level("INFO", logger=state_transfer.__name__):
            second = loop.run(state_transfer.download_state(peers[3], [a, b], "run", min_step=5,
                                                            max_bytes=len(blob) + 10, attempts=1), timeout=60)
        assert second == (5, blob, digest) and free.served == 1 and busy.served == 1
        assert any("busy" in r.getMessage() and a in r.getMessage() for r in caplog.records)
        loop.run(busy.offer(5, blob, digest), timeout=10)
        assert first.result(30) == (5, blob, digest) and busy._uploads == 0
    finally:
        _close_peers(loop, peers)


def test_a_new_download_gets_the_donors_current_step_not_a_snapshot_cached_for_an_older_one(monkeypatch):
    """A donor keeps the snapshot it made for an earlier download. A repair asking for "step 3 or
    later" got that one, 16 steps old, and was still behind (a 1 Mbit/s peer downloaded twice). A new
    download gets the donor's current step; a resumed one still gets the cached snapshot it resumes;
    a donor whose current state does not come within ``FRESH_WAIT_S`` serves the cached one."""
    monkeypatch.setattr(state_transfer, "FRESH_WAIT_S", 1.0)
    _, old_opt = _opt(0, hidden=64)
    _, new_opt = _opt(1, hidden=64)
    (old_blob, old_digest), (new_blob, new_digest) = snapshot.encode(old_opt), snapshot.encode(new_opt)
    current = {"step": 19, "made": (19, new_blob, new_digest)}
    loop = BackgroundLoop()

    async def setup():
        peers = await _p2p_peers(2)
        server = state_transfer.StateServer(peers[0], "run", provider=lambda step: current["made"],
                                            current_step=lambda: current["step"])
        await server.start()
        await server.offer(3, old_blob, old_digest)  # made for an earlier download
        return peers, server

    peers, server = loop.run(setup(), timeout=60)
    donor = [peers[0].peer_id.to_base58()]
    fetch = lambda: loop.run(state_transfer.download_state(  # noqa: E731
        peers[1], donor, "run", min_step=3, max_bytes=len(new_blob) + 10, attempts=1), timeout=60)
    try:
        assert fetch() == (19, new_blob, new_digest)
        loop.run(server.offer(3, old_blob, old_digest), timeout=10)
        resumed = state_transfer._Download()
        resumed.blob += old_blob[:100]
        resumed.step, resumed.digest, resumed.total = 3, old_digest, len(old_blob)
        loop.run(state_transfer._fetch_from(peers[1], donor[0], "run", 3, len(old_blob) + 10, resumed, None, b"",
                                            False), timeout=60)
        assert bytes(resumed.blob) == old_blob  # resumed within the cached snapshot, not started over
        current["step"], current["made"] = 25, None  # stepping: no state between steps within the wait
        started = time.monotonic()
        assert fetch() == (3, old_blob, old_digest)
        assert time.monotonic() - started >= 1.0
    finally:
        _close_peers(loop, peers)


def test_a_followers_state_download_is_preceded_by_a_record_that_outlives_it(monkeypatch):
    """A 1 Mbit/s link carrying a 22 MB state starves the periodic announcements for minutes; the
    leader dropped the member when its record expired. A follower's download is preceded by a record
    that outlives the download's bound (``download_bound``); a voter's is not."""
    from lioncub_p2p.allreduce.admission import OPEN
    from lioncub_p2p.swarm.state_sync import StateSync

    events = []

    class _Upkeep:
        records: dict = {}

        async def announce(self, *, hold_s=0.0):
            events.append(("announce", hold_s))

    async def download_state(*args, timeout, **kwargs):
        events.append(("download", timeout))
        return 3, b"", b""

    monkeypatch.setattr("lioncub_p2p.swarm.state_sync.download_state", download_state)
    loop = BackgroundLoop()
    try:
        state = StateSync(p2p=None, loop=loop, run_id="run", peer_id="me", admission=OPEN, upkeep=_Upkeep(),
                          liars=dict, max_uploads=1, join_timeout=60.0, round_bound=10.0)
        state.optimizer = _opt(0, hidden=64)[1]
        group = GroupRecord(1, 3, (PeerSpec("me"), PeerSpec("donor")))
        state.catch_up("repair", 3, group, params_only=True)  # a voter: its record may tell another group it is gone
        state.catch_up("repair", 3, group, params_only=True, slow_link=True)  # a follower
    finally:
        loop.stop()
    bound = state_transfer.download_bound(snapshot.max_size(state.optimizer), 60.0)
    assert events == [("download", bound), ("announce", bound), ("download", bound)]


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

FAST = SWARM_ROUNDS
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _config(run_id: str, **kwargs) -> SwarmConfig:
    """A swarm member on loopback with short round timeouts."""
    return SwarmConfig(run_id, **{"host_maddrs": LOOPBACK, "allreduce": FAST, **kwargs})


def _train_swarm(configs, steps, *, perturb=None, hidden=64, instrument=None, late=None, stall=None, slow=None,
                 diverge_at_end=None):
    """Run one Swarm per config in its own thread until the global step reaches ``steps``.

    ``perturb=(peer, step, index)`` adds 1e-3 to the first parameter of that peer before that step
    (all of it, or only flat element ``index``; ``peer`` may be a predicate of (i, swarm)); ``instrument(i, swarm)`` runs before training;
    ``late=(peer, step)``: that peer joins once peer 0 reached that step (the others start without it,
    and step slowly from 10 steps before the end until it has joined);
    ``stall=(peer, step, seconds)``: that peer sleeps before that step (``peer="last"``: the one last in
    group order; a predicate of (i, swarm), asked at that step; ``out["stalled"]``); ``slow=(peer, seconds)``: that peer
    sleeps so long after every step (the others 0.02 s); ``diverge_at_end``: that peer shifts its parameters
    after its last step. Each peer stops at ``steps`` (its ``final_step``, as lioncub-train sets it),
    settles the final state with the group (``Swarm.settle_final_state``; ``out["final_repairs"]``) and
    stays up until every peer has stopped.
    Per peer: (step, parameter digest, repairs since the perturbation, snapshot digest)."""
    task = digits_task(0, hidden=hidden)
    first = Swarm(configs[0])
    maddrs = first.visible_maddrs()
    swarms = [first] + [Swarm(c.__class__(**{**c.__dict__, "initial_peers": maddrs})) for c in configs[1:]]
    out, errors, progress = {"repair_steps": {}}, [], {}
    if stall and stall[0] == "last":  # the peer last in group order (members are sorted): never the first leader
        stall = (max(range(len(swarms)), key=lambda i: swarms[i].peer_id), *stall[1:])
        out["stalled"] = stall[0]

    def run(i, swarm):
        try:
            model = task.make_model(seed=i)
            opt = LionCub(model.named_parameters(), lr=1e-3, weight_decay=0.1, aggregator=swarm)
            if late and late[0] == i:
                deadline = time.monotonic() + 60
                while progress.get(0, 0) < late[1] and time.monotonic() < deadline and not errors:
                    time.sleep(0.05)
            swarm.final_step = steps
            expected = len(swarms) - (late is not None and late[0] != i)
            # start together: repairs then count only faults
            out.setdefault("start", {})[i] = swarm.join(opt, wait_peers=expected, wait_timeout=60)
            out.setdefault("joined_in_flight", {})[i] = opt.in_flight is not None
            x, y = task.shard(i, len(swarms))
            gen = torch.Generator().manual_seed(i)
            repairs_before, rejoins_before, skips_before, repair_steps = 0, 0, 0, out["repair_steps"].setdefault(i, [])
            while opt.step_count < steps and swarm.stranded is None:  # a trainer stops there
                if stall and stall[1] == opt.step_count \
                        and (stall[0](i, swarm) if callable(stall[0]) else stall[0] == i):
                    out["stalled"] = i
                    time.sleep(stall[2])
                if perturb and opt.step_count == perturb[1]:
                    repairs_before = swarm.repairs  # counted from the perturbed step on (a start-up race may repair)
                    rejoins_before, skips_before = swarm.rejoins, swarm.skips
                    repair_steps.clear()
                    if perturb[0](i, swarm) if callable(perturb[0]) else perturb[0] == i:
                        with torch.no_grad():
                            first_param = next(model.parameters())
                            if len(perturb) > 2:  # one element: a bit flip's worth of divergence
                                first_param.view(-1)[perturb[2]] += 1e-3
                            else:
                                first_param.add_(1e-3)
                idx = torch.randint(0, len(x), (32,), generator=gen)
                nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                before = opt.step_count
                opt.step()
                opt.zero_grad()
                if swarm.stats.repaired:
                    repair_steps.append(before)
                    out.setdefault("all_repair_steps", {}).setdefault(i, []).append(before)
                progress[i] = opt.step_count
                out.setdefault("stepped_at", {}).setdefault(i, []).append((before, time.monotonic()))
                out.setdefault("round_s", {}).setdefault(i, []).append((before, swarm.stats.round_s))
                out["max_lead"] = max(out.get("max_lead", 0), max(progress.values()) - min(progress.values()))
                if swarm.stats.followed:
                    out.setdefault("followed", {}).setdefault(i, []).append(before)
                if swarm.last_report is not None and swarm.last_report.combine is not None:  # two-level
                    out.setdefault("combined", {}).setdefault(i, []).append(before)
                pause = slow[1] if slow and slow[0] == i else 0.02
                if late and late[0] != i and opt.step_count >= steps - 10 and late[0] not in out.get("start", {}):
                    pause = 0.5  # the late peer is still joining: leave it steps to join at (a loaded CI machine
                    # once ran all 40 steps before its join was through, and it joined the final state)
                time.sleep(pause)
            if diverge_at_end == i:  # after its last round: nothing but the closing check can tell
                with torch.no_grad():
                    next(model.parameters()).add_(1e-3)
            trained = time.monotonic()
            swarm.settle_final_state(60.0)  # as lioncub-train does after its last step (its --linger)
            out.setdefault("settle_s", {})[i] = time.monotonic() - trained
            out.setdefault("final_repairs", {})[i] = swarm.final_repairs
            out[i] = (opt.step_count, snapshot.params_digest(opt), swarm.repairs - repairs_before,
                      snapshot.encode(opt)[1])
            out.setdefault("repairs", {})[i] = swarm.repairs
            out.setdefault("rejoins", {})[i] = swarm.rejoins - rejoins_before  # since the perturbation
            out.setdefault("skips", {})[i] = swarm.skips - skips_before
        except Exception as e:  # surfaced by the assertions below
            errors.append(e)

    if instrument is not None:
        for i, swarm in enumerate(swarms):
            instrument(i, swarm)
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


@pytest.mark.slow
def test_members_that_cannot_read_group_records_follow_the_groups_their_leader_sends_them(caplog):
    """The leader sends each new group record to its members as it publishes it (group_notice.py). Peers
    0 and 1 read no group record from the DHT once they step (their reads come back empty): the group
    that adds peer 2 reaches the one of them that does not lead only as a notice. All three end equal,
    every one of them in that group."""
    configs = [_config("notices") for _ in range(3)]
    seen: dict[int, Swarm] = {}

    def no_group_reads(i: int, swarm: Swarm) -> None:
        seen[i] = swarm
        if i == 2:
            return
        read = swarm.directory.groups

        async def groups():
            stepping = swarm.optimizer is not None and swarm.optimizer.step_count > 0
            return [] if stepping else await read()
        swarm.directory.groups = groups

    with caplog.at_level(logging.INFO, logger="lioncub_p2p.swarm"):
        out = _train_swarm(configs, 30, late=(2, 8), instrument=no_group_reads)
    assert {out[i][0] for i in range(3)} == {30}
    assert len({out[i][1] for i in range(3)}) == 1
    newcomer = seen[2].peer_id
    for i in range(3):  # the group that took the newcomer in, in everybody's history
        assert any(newcomer in g.member_ids() for g in seen[i].history.by_epoch.values()), i
    assert "pushed at step" in caplog.text, caplog.text[-3000:]


def _repaired_in(out: dict, peers: list[int], first: int, last: int) -> dict[int, list[int]]:
    """Repairs of ``peers`` at steps first..last. Only those count against a test: under CI load a peer
    may be dropped for a slow round and come back later, which can cost it a repair of its own."""
    found = {i: [s for s in out["repair_steps"].get(i, []) if first <= s <= last] for i in peers}
    return {i: steps for i, steps in found.items() if steps}


@pytest.mark.slow
def test_diverged_peer_repairs_itself_within_a_round():
    configs = [_config("repair", momentum=MomentumSchedule(every=5)) for _ in range(3)]
    out = _train_swarm(configs, 30, perturb=(2, 15))
    assert {out[i][0] for i in range(3)} == {30}
    assert len({out[i][1] for i in range(3)}) == 1  # identical parameters at the end
    assert out[2][2] >= 1 and out["repair_steps"][2][0] == 15  # repaired in the very round after the perturbation
    assert not _repaired_in(out, [0, 1], 15, 18)  # nobody else did then (later, a drop under load may)


@pytest.mark.slow
def test_a_pair_that_diverged_meets_again_within_a_round():
    """Two peers have no majority: every part counts one vote for each state. The one that is not the
    group's author repairs from the author in the round after the split and they end equal (counting
    only a majority of votes, they stayed apart until the closing check)."""
    configs = [_config("pair") for _ in range(2)]
    out = _train_swarm(configs, 24, perturb=(1, 12))
    assert {out[i][0] for i in range(2)} == {24}
    assert len({out[i][1] for i in range(2)}) == 1
    assert _repaired_in(out, [0, 1], 12, 14), out["repair_steps"]  # in the rounds, not at the closing


@pytest.mark.slow
def test_a_peer_that_diverged_after_the_last_round_takes_the_groups_final_parameters():
    """A split in the last round has no later round to show it (a round that failed for some members, a
    group change at the last step): peer 2 shifts its parameters after its last step, and the closing
    check (``Swarm.settle_final_state``) has it download the parameters the two others ended with."""
    configs = [_config("closing") for _ in range(3)]
    out = _train_swarm(configs, 12, diverge_at_end=2)
    assert {out[i][0] for i in range(3)} == {12}
    assert len({out[i][1] for i in range(3)}) == 1  # identical parameters at the end
    assert out["final_repairs"] == {0: 0, 1: 0, 2: 1}


@pytest.mark.slow
def test_an_overlapped_peer_whose_last_round_shows_it_diverged_repairs_inside_the_final_flush():
    """Overlapped rounds: peer 2 is perturbed before its last step, so only the round still in flight when
    training ends shows it (``LionCub.flush`` in the closing check). That repair asked for a state past the
    last step, which nobody reaches: it waited the whole download bound, and had a donor served one, it
    would have loaded it under the step lock that flush holds (a hang). Now it asks for the last step and
    ends equal, well within the closing's wait."""
    configs = [_config("final-flush", delay=1) for _ in range(3)]
    out = _train_swarm(configs, 16, perturb=(2, 15))
    assert {out[i][0] for i in range(3)} == {16}
    assert len({out[i][1] for i in range(3)}) == 1, [out[i][1].hex()[:8] for i in range(3)]
    # repaired: by the last round's tags inside the flush, or (a loaded machine: that download failed) by
    # the closing's digests, or (dropped from the group or left behind by a slow round under load) by the
    # state it downloaded to rejoin or skip ahead; either way well within the closing's wait, where the old
    # repair first waited out the whole download bound (120 s and more) for a step nobody reaches
    replaced = out[2][2] + out["final_repairs"][2] + out["rejoins"][2] + out["skips"][2]
    # ...unless the last round split the others too (a part one peer received and another did not): with
    # three states and no majority the closing follows the leader's, which may be peer 2's; then both
    # others downloaded it (two holding one state are a majority and never do)
    split_three_ways = out["final_repairs"][0] and out["final_repairs"][1]
    assert replaced >= 1 or split_three_ways, (out[2][2], out["final_repairs"], out["rejoins"], out["skips"])
    assert not _repaired_in(out, [0, 1], 15, 16), out["repair_steps"]  # nobody took the perturbed state
    assert out["settle_s"][2] < 60, out["settle_s"]


@pytest.mark.slow
def test_a_two_level_run_keeps_every_peer_bitwise_equal_through_a_repair():
    """max_group 2, 6 peers: 3 groups drawn from the group record (no matchmaking) vote inside
    themselves, each part's counts are combined among the groups' reducers of that part, and every peer
    applies the flat majority: a perturbed peer is repaired, and all end bitwise equal."""
    configs = [_config("two-level", max_group=2, momentum=MomentumSchedule(every=5)) for _ in range(6)]
    swarms: dict[int, Swarm] = {}
    out = _train_swarm(configs, 30, perturb=(4, 15), instrument=swarms.__setitem__)
    assert {out[i][0] for i in range(6)} == {30}
    assert all(s.node.in_run == s.book.in_run for s in swarms.values())  # the fetch gate knows the run's members
    assert len({out[i][1] for i in range(6)}) == 1  # identical parameters at the end
    assert out[4][2] >= 1  # the perturbed peer repaired
    combined = out.get("combined", {})
    assert sum(len(steps) for steps in combined.values()) >= 3 * 20, combined  # second-level rounds ran


@pytest.mark.slow
def test_a_two_level_group_that_diverged_as_a_whole_is_repaired_from_the_other_groups():
    """Both members of a group of 2 (3 groups) shift their parameters alike: inside their group they
    agree, so only the second level, where each group's reducer votes its group's state tag, can tell
    them that the other groups hold another state. They repair (from members of other groups first)
    and every peer ends bitwise equal."""
    ids: dict[int, str] = {}
    perturbed: set[int] = set()

    def with_peer_0(i: int, swarm: Swarm) -> bool:
        group = swarm.history.for_step(15)
        layout = hierarchy.two_level_layout(group.member_ids(), group.epoch, swarm.optimizer.buffer_bytes, 2,
                                            reducers={m.peer_id for m in group.members if m.reduces})
        if any(ids[0] in g and swarm.peer_id in g for g in layout.groups):
            perturbed.add(i)
            return True
        return False

    configs = [_config("two-level-split", max_group=2) for _ in range(6)]
    out = _train_swarm(configs, 30, perturb=(with_peer_0, 15),
                       instrument=lambda i, swarm: ids.__setitem__(i, swarm.peer_id))
    assert len(perturbed) == 2, perturbed
    assert {out[i][0] for i in range(6)} == {30}
    assert len({out[i][1] for i in range(6)}) == 1  # identical parameters at the end
    assert all(out[i][2] >= 1 for i in perturbed), {i: out[i][2] for i in range(6)}


@pytest.mark.slow
def test_overlapped_rounds_keep_peers_bitwise_equal_through_a_repair_and_a_late_join():
    """delay = 1: each vote travels during the next step. A peer perturbed before step 15 is found out
    by the vote of step 15 while step 16 runs, and repaired from a peer (the state it downloads holds
    that peer's vote in flight); a peer that joins at step ~12 downloads a state with a vote in flight.
    All end with equal parameters and equal votes in flight, the late one included."""
    configs = [_config("overlap", momentum=MomentumSchedule(every=5), delay=1) for _ in range(4)]
    out = _train_swarm(configs, 40, perturb=(2, 15), late=(3, 12))
    assert {out[i][0] for i in range(4)} == {40}
    assert len({out[i][1] for i in range(4)}) == 1 and len({out[i][3] for i in range(4)}) == 1
    assert out["start"][3] >= 12 and out["joined_in_flight"][3]  # the late peer got the state with a vote in flight
    late_repairs = out.get("all_repair_steps", {}).get(3, [])  # ...and applied it: no divergence after joining
    assert not [s for s in late_repairs if s <= out["start"][3] + 5], late_repairs
    assert out[2][2] >= 1 and out["repair_steps"][2][0] == 16  # repaired in the step that received vote 15
    assert not _repaired_in(out, [0, 1, 3], 15, 19)  # nobody else did then


@pytest.mark.slow
def test_a_peer_dropped_near_the_end_still_ends_with_the_final_state(monkeypatch, caplog):
    """Peer 2 stalls 10 steps before the end, long enough to be dropped; the others finish. It comes
    back to a group it may no longer be in and catches up: it rejoins (the leader starts that group at
    the last step, not past it, where nobody would ever serve a state) and downloads the final state
    from a peer that finished, or it fetches the results of the rounds it missed. All end bitwise equal."""
    from lioncub_p2p.swarm import lead

    drop_after = 2.0  # the leader drops a member after this long without its votes (5 s in a real run)
    monkeypatch.setattr(lead, "DROP_AFTER_S", drop_after)
    configs = [_config("late-end") for _ in range(3)]
    with caplog.at_level(logging.INFO, logger="lioncub_p2p.swarm"):
        out = _train_swarm(configs, 30, stall=(2, 20, 3 * drop_after))
    assert {out[i][0] for i in range(3)} == {30}
    assert len({out[i][1] for i in range(3)}) == 1
    # the path under test: back from its stall it catches up with the others: it downloads a state of
    # theirs (the final one, or one a few steps before it when they had not finished yet), whether it saw
    # itself out of the group first (rejoining) or its rounds found nobody left (skipping ahead), or it
    # fetches the results of the rounds it missed, which its peers still keep (following)
    loaded = [int(step) for step in re.findall(r"loaded the swarm's state at step (\d+)", caplog.text)]
    followed = out.get("followed", {}).get(2, [])
    assert max(loaded, default=0) >= 25 or max(followed, default=0) >= 25, (loaded, followed)
    if max(loaded, default=0) >= 25:  # a download is always announced, and says why
        assert "rejoining" in caplog.text or "downloading the state" in caplog.text
    assert out["final_repairs"] == {0: 0, 1: 0, 2: 0}  # equal by then: not by the closing check's download


def _stalled_run(name: str, steps: int, seconds: float, caplog) -> tuple[dict, str, list[GroupRecord], set[str]]:
    """4 members train ``steps`` steps, the last one stalling ``seconds`` at step 15; all must end at
    ``steps`` with equal parameters. The run's output, the stalled peer, the groups another saw, and
    the members whose part the leader (the first in group order) saw fail alone."""
    seen = {}
    with caplog.at_level(logging.INFO, logger="lioncub_p2p.swarm"):
        out = _train_swarm([_config(name) for _ in range(4)], steps, stall=("last", 15, seconds),
                           instrument=lambda i, s: seen.setdefault(i, s))
    assert {out[i][0] for i in range(4)} == {steps}
    assert len({out[i][1] for i in range(4)}) == 1
    groups = sorted(seen[(out["stalled"] + 1) % 4].history.by_epoch.values(), key=lambda g: g.epoch)
    leader = min(seen.values(), key=lambda s: s.peer_id)
    return out, seen[out["stalled"]].peer_id, groups, set(leader.upkeep.part_failed_at)


@pytest.mark.slow
def test_a_stalled_reducer_rests_without_a_part_instead_of_costing_every_round_a_timeout(caplog):
    """A member stalls 3 s (under the 5 s after which it would be dropped). A round whose votes reach it
    before it runs the step before loses its part after the join timeout (those that reach it while it
    runs the step before are held until its round starts); when the leader sees that part missing while
    the others came through, it gives it no part for ``REST_S`` (it still votes), so the group's next
    rounds do not wait on it. It is never dropped, at most 2 rounds are slow, everyone ends equal.
    (Which rounds lose its part depends on timing since the hold; the rest itself: ``test_lead.py``.)"""
    out, stalled, groups, failed_alone = _stalled_run("rest", 50, 3.0, caplog)
    weights = [(g.from_step, {m.peer_id: m.weight for m in g.members}.get(stalled)) for g in groups]
    # without the rest it came back a reducer still behind, its part kept failing, and it was dropped
    assert all(weight is not None for step, weight in weights if 15 < step < 50), weights
    slow = {i: [step for step, seconds in out["round_s"][i] if step > 15 and seconds > 1.5] for i in range(4)
            if i != out["stalled"]}
    assert all(len(steps) <= 2 for steps in slow.values()), slow  # the stall's round (and one more under load)
    if stalled in failed_alone:  # a later group gives it no part: it rests (or follows: its votes came late)
        assert any(step > 15 and weight == 0.0 for step, weight in weights), weights  # (0 at the start: syncing)
    if f"{stalled} reduces nothing for the next" in caplog.text:
        assert stalled in failed_alone


@pytest.mark.slow
def test_a_member_dropped_for_a_stall_rejoins_on_probation_without_a_part_until_its_vote_counts(caplog):
    """A member stalls 8 s: past the 5 s and 2 rounds after which the leader drops it. When it comes back
    the leader re-adds it without a part and does not drop it again for missed votes (it follows: its
    votes would come too late). Everyone ends equal."""
    _, stalled, groups, _ = _stalled_run("probation", 100, 8.0, caplog)
    assert f"{stalled} rejoins without a part, on probation" in caplog.text, caplog.text[-3000:]
    # groups from the last step on are the run's end: a member that finished and said so leaves them
    weights = [{m.peer_id: m.weight for m in g.members}.get(stalled) for g in groups if g.from_step < 100]
    back = [i for i, w in enumerate(weights) if i > 0 and w is not None and weights[i - 1] is None]
    assert back and weights[back[-1]] == 0.0, weights  # dropped, then re-added with no part
    assert all(w is not None for w in weights[back[-1]:]), weights  # not dropped again (it follows)


def _outside_the_leaders_group(i: int, swarm: Swarm) -> bool:
    """The member last in group order of those outside the first member's group (the leader's, while
    everyone is healthy) in the two-level vote of this peer's step."""
    group = swarm.history.for_step(swarm.optimizer.step_count)
    groups = swarm.book.groups_of(group)
    others = sorted(pid for pid in groups if pid not in groups[group.members[0].peer_id])
    return bool(others) and swarm.peer_id == others[-1]


@pytest.mark.slow
def test_a_member_of_another_group_that_stalls_is_dropped_on_its_group_mates_reports_and_all_end_equal(caplog):
    """Two-level vote, 6 peers in 3 groups of 2. A member outside the leader's group stalls 12 s (its
    event loop still announces it): the leader counts no votes of that group, but its group-mate reports
    the missed votes in its record, so the leader drops it as it would a member of its own group
    and re-adds it on probation (which its group-mates' steady reports end: tests/test_lead.py).
    Everyone ends equal."""
    configs = [_config("two-level-stall", max_group=2) for _ in range(6)]
    seen: dict[int, Swarm] = {}
    with caplog.at_level(logging.INFO, logger="lioncub_p2p.swarm"):
        # 70 steps: seen alone, dropped at step 24 and back on probation at 43 (the closing check covers the end)
        out = _train_swarm(configs, 70, stall=(_outside_the_leaders_group, 15, 12.0),
                           instrument=lambda i, s: seen.setdefault(i, s))
    assert {out[i][0] for i in range(6)} == {70}
    assert len({out[i][1] for i in range(6)}) == 1, (out["stalled"], [out[i][1].hex()[:8] for i in range(6)],
                                                     out.get("all_repair_steps"), out.get("followed"),
                                                     out["final_repairs"])
    stalled = seen[out["stalled"]].peer_id
    watcher = seen[(out["stalled"] + 1) % 6]
    groups = sorted(watcher.history.by_epoch.values(), key=lambda g: g.epoch)
    members = [(g.from_step, stalled in g.member_ids()) for g in groups if g.from_step < 70]
    dropped = [step for k, (step, member) in enumerate(members) if k > 0 and members[k - 1][1] and not member]
    assert dropped and dropped[0] > 15, members  # dropped after its stall began...
    assert f"{stalled} rejoins without a part, on probation" in caplog.text, caplog.text[-3000:]  # ...and back
    specs = [{m.peer_id: m for m in g.members}.get(stalled) for g in groups if g.from_step > dropped[0]]
    assert next(spec for spec in specs if spec is not None).weight == 0.0  # no part while on probation


def _a_whole_group_outside_the_leaders(i: int, swarm: Swarm) -> bool:
    """Every member of the group of the last member in group order outside the first member's group."""
    group = swarm.history.for_step(swarm.optimizer.step_count)
    groups = swarm.book.groups_of(group)
    others = sorted(pid for pid in groups if pid not in groups[group.members[0].peer_id])
    return bool(others) and swarm.peer_id in groups[others[-1]]


@pytest.mark.slow
def test_a_group_whose_members_all_stall_is_dropped_on_their_own_records_and_all_end_equal(caplog):
    """Two-level vote, 6 peers in 3 groups of 2. Both members of a group outside the leader's stall 20 s
    (their event loops still announce): no group-mate is left to report their missed votes, but their
    records repeat one step while the leader moves on (``lead.Stalls``), so the leader drops them during
    the stall; the other four train on, the two come back, and everyone ends equal."""
    configs = [_config("two-level-group-stall", max_group=2) for _ in range(6)]
    seen: dict[int, Swarm] = {}
    stall_s = 20.0
    with caplog.at_level(logging.INFO, logger="lioncub_p2p.swarm"):
        out = _train_swarm(configs, 80, stall=(_a_whole_group_outside_the_leaders, 15, stall_s),
                           instrument=lambda i, s: seen.setdefault(i, s))
    assert {out[i][0] for i in range(6)} == {80}
    assert len({out[i][1] for i in range(6)}) == 1, [out[i][1].hex()[:8] for i in range(6)]
    at = out["stepped_at"]
    stalled = [i for i in range(6) if any(b - a > stall_s - 1 for (_, a), (_, b) in zip(at[i], at[i][1:]))]
    assert len(stalled) == 2, stalled
    woke = min(next(t for (s, t) in at[i] if s == 15) for i in stalled)  # their step 15 ended after the stall
    watcher = seen[next(i for i in range(6) if i not in stalled)]
    groups = sorted(watcher.history.by_epoch.values(), key=lambda g: g.epoch)
    ids = {seen[i].peer_id for i in stalled}
    out_at = next((g.from_step for g in groups if g.from_step > 15 and not ids & set(g.member_ids())), None)
    assert out_at is not None, [(g.from_step, len(g.members)) for g in groups]
    # dropped while they slept: the others reached that group's first step before the two woke up (3 of
    # the 4: while every round waits on the stalled group, an honest peer now and then misses 2 rounds
    # for 5 s and is dropped by the leader's own count, then re-added on probation: 2 of ~12 runs)
    others_then = [max((s for s, t in at[i] if t < woke), default=0) for i in range(6) if i not in stalled]
    during = [sum(woke - stall_s < t < woke for _, t in at[i]) for i in range(6) if i not in stalled]
    assert sorted(others_then)[1] >= out_at, (others_then, out_at, "steps the others made during the stall", during)


@pytest.mark.slow
def test_drift_the_sampled_tag_misses_is_repaired_at_the_next_full_digest():
    """state_tag samples every stride-th element; the full digest every ``full_digest_every`` steps
    covers the rest. A perturbation of an unsampled element is repaired at the next full-digest step."""
    hidden, every = 384, 10
    numel = sum(p.numel() for p in digits_task(0, hidden=hidden).make_model(0).parameters())
    stride = numel // (1 << 16)
    assert stride >= 2  # element 1 of the first parameter is never sampled
    configs = [_config("drift", momentum=MomentumSchedule(), full_digest_every=every) for _ in range(3)]
    out = _train_swarm(configs, 25, perturb=(1, 13, 1), hidden=hidden)
    assert len({out[i][1] for i in range(3)}) == 1
    assert out["repair_steps"][1] == [20] and out["repair_steps"][0] == out["repair_steps"][2] == []


def test_momentum_patterns_that_select_nothing_stop_join_with_a_hint():
    swarm = Swarm(_config("names", momentum=MomentumSchedule(every=5, params=("0.*",))))
    try:
        model = digits_task(0, hidden=8).make_model(0)
        with pytest.raises(SwarmError, match=r"selects none.*LionCub\(model.named_parameters\(\), ...\)"):
            swarm.join(LionCub(model.parameters(), aggregator=swarm))  # names are group0.paramK: nothing matches
        assert swarm.optimizer is None  # refused before anything started
    finally:
        swarm.shutdown()


class _MomentumProbe:
    """Records each momentum sync of one peer as it is kept: (step, what it sent, all momenta just
    before and just after its result was written, spec, report, synced). A whole-buffer sync is kept
    in the step that ran it; a streamed one after the next step (``MomentumRounds.stream``)."""

    def __init__(self, swarm: Swarm):
        self.swarm, self.syncs, self._reports = swarm, [], {}
        run_round, join = swarm.node.run_round, swarm.join

        async def recording_run_round(spec, upload, tag=b"", **kwargs):
            update, report = await run_round(spec, upload, tag, **kwargs)
            if spec.upload.name in ("bf16", "fp8"):  # momentum rounds
                self._reports[spec.step] = (spec, report)
            return update, report

        def momenta():
            return [(n, m.detach().clone()) for n, m in swarm.optimizer.momentum_buffers()]

        def record(step, sent, before, synced, alone=True):
            spec, report = self._reports.pop(step, (None, None))
            self.syncs.append((step, sent, before, momenta(), spec, report, synced, alone))

        def joined(*args, **kwargs):  # the momentum rounds exist from join on
            start = join(*args, **kwargs)
            rounds = swarm.momentum
            average, stream = rounds.average, rounds.stream

            def recording_average(step):
                before = momenta()
                sent = rounds.sync.selected(step)
                sent = torch.cat([m.view(-1)[lo:hi].float() for m, lo, hi in sent]).numpy().copy()
                synced = average(step)
                record(step, sent, before, synced)
                return synced

            def recording_stream(step):
                in_flight, before = list(rounds.in_flight), momenta()
                synced = stream(step)
                kept = [s for s in in_flight if s not in rounds.in_flight]  # no downloads here: all finished
                for sent in kept:
                    record(sent.step, sent.flat.numpy().copy(), before, sent.future.result()[1].missing_parts == [],
                           alone=len(kept) == 1)
                return synced

            rounds.average, rounds.stream = recording_average, recording_stream
            return start

        swarm.node.run_round = recording_run_round
        swarm.join = joined


@pytest.mark.slow
@pytest.mark.parametrize("schedule, sync_steps", [
    (MomentumSchedule(geometric=2.0, start=2, params=("0.*",)), [2, 4, 8, 16]),
    # streamed: a third per step, each kept after a later step (the last ones' never: training ended)
    (MomentumSchedule(slices=3, params=("0.*",)), list(range(1, 19))),
    (MomentumSchedule(slices=3, params=("0.*",), wire="fp8"), list(range(1, 19))),
], ids=["geometric", "streamed", "streamed-fp8"])
def test_swarm_momentum_sync_is_the_trimmed_mean_of_the_selected_buffers(schedule, sync_steps):
    """The momenta after a swarm sync equal an independent numpy trimmed mean (bf16 or fp8 blocks on
    the wire, both legs) of what the peers sent of their selected buffers at that step (the step's
    slice of each, when streamed), over the voters each part counted; a streamed one, kept a step
    later, adds what the momentum did meanwhile (average + now - sent); everything else is
    untouched. The schedule selects layer 0 only."""
    configs = [_config("momentum", momentum=schedule) for _ in range(3)]
    probes = {}
    _train_swarm(configs, 18, instrument=lambda i, swarm: probes.__setitem__(i, _MomentumProbe(swarm)))
    steps = [[s[0] for s in probes[i].syncs] for i in range(3)]
    common = min(len(s) for s in steps)
    if schedule.slices:  # every slice's round ends; a step keeps those that ended before it, in order
        assert common >= 12 and all(s == sync_steps[: len(s)] for s in steps), steps
    else:
        assert steps == [sync_steps] * 3
    selected = ["0.weight", "0.bias"]

    def wire(a: np.ndarray) -> np.ndarray:  # what the values are after a trip over the wire
        if schedule.wire == "fp8":
            return from_fp8_blocks(fp8_blocks(a))[: len(a)]
        return torch.from_numpy(a).to(torch.bfloat16).float().numpy()

    def synced_part(momenta, step):  # the selected elements this step averages, flat
        return np.concatenate([m.numpy().ravel()[slice(*schedule.slice_of(step, m.numel()))]
                               for n, m in momenta if n in selected])

    checked = 0
    for k in range(common):
        syncs = [probes[i].syncs[k] for i in range(3)]
        ids = [probes[i].swarm.peer_id for i in range(3)]
        assert [n for n, _ in syncs[0][2] if schedule.selects(n)] == selected
        flats = [s[1] for s in syncs]
        spec, report = syncs[0][4], syncs[0][5]
        expected = flats[0].copy()
        for part in report.parts:
            span = spec.upload.value_span(part.start, part.stop)
            a, b = span.start, min(span.stop, len(expected))
            if b <= a or part.status not in ("ok", "recovered"):
                continue
            rows = np.stack([wire(flats[ids.index(spec.group[v].peer_id)])[a:b] for v in part.counted])
            n = len(rows)
            if n == 2:  # nothing to trim: both clipped to the smaller of the maxima their voters signed
                limit = np.abs(rows).max(axis=1).min()
                rows = np.clip(rows, -limit, limit)
            trim = max(1, int(n * 0.2)) if n >= 3 else 0
            trim = min(trim, (n - 1) // 2)
            kept = np.sort(rows, axis=0)[trim : n - trim]
            mean = kept.mean(axis=0, dtype=np.float32)
            expected[a:b] = wire(np.append(mean, np.zeros(span.stop - b, np.float32)))[: b - a]  # blocks from a
        for i, (step, sent, before, after, _, peer_report, synced, alone) in enumerate(syncs):
            assert synced and not peer_report.missing_parts
            if not alone:  # kept in the same step as another slice: "before" is not just before this one
                continue
            checked += 1
            now = synced_part(before, step)
            want = now + (expected - sent) if schedule.slices else expected
            assert np.array_equal(synced_part(after, step), want), (k, i)
            for (n, m0), (_, m1) in zip(before, after):
                lo, hi = schedule.slice_of(step, m0.numel()) if n in selected else (0, 0)
                outside = np.ones(m0.numel(), dtype=bool)
                outside[lo:hi] = False
                # unselected momenta, and the rest of a streamed one, are not averaged
                assert torch.equal(m0.view(-1)[outside], m1.view(-1)[outside]), (n, step)
    assert checked >= 2 * common, (checked, common)  # most syncs are kept one at a time


@pytest.mark.slow
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


def test_the_old_wait_for_peers_names_its_replacement_in_one_line():
    with pytest.raises(SwarmError, match=r"pass wait_peers=3 \(and wait_timeout=60\) to join\(\) instead") as gone:
        Swarm.wait_for_peers(object.__new__(Swarm), 3, timeout=60)
    assert "\n" not in str(gone.value)


@pytest.mark.parametrize("newcomer_reads_every", [0.5, 2.0])
def test_a_founder_slow_to_take_its_first_step_lists_a_newcomer_for_a_later_one(newcomer_reads_every):
    """A founder whose first step comes late (a slow first forward pass, a compile) while a newcomer
    already waits: it listed the newcomer from step 0 as if it were waiting for peers, then stepped in
    that group, whose round waited for the newcomer's vote while the newcomer waited for the state of
    step 0, which the founder had no snapshot of until the round ended (the 8 s upload timeout here,
    10 s by default: most runs whose peers started together without ``--wait-peers``). A peer that
    left ``join`` is stepping: its groups take effect ahead, and nobody waits. A newcomer that reads
    its group late (every 2 s) asks for the state of its first step after the founder took it: the
    founder made a snapshot as it entered that step (``Swarm._adds_newcomers_at``)."""
    rounds = replace(FAST, upload_timeout=8.0, result_timeout=12.0)
    task = digits_task(0, hidden=32)
    first = Swarm(_config("together", allreduce=rounds))
    second = Swarm(_config("together", allreduce=rounds, initial_peers=first.visible_maddrs(),
                           refresh_period=newcomer_reads_every))
    step_s: dict[int, list[float]] = {}
    digests: dict[int, bytes] = {}
    errors: list[Exception] = []

    def run(i: int, swarm: Swarm) -> None:
        try:
            model = task.make_model(seed=0)
            opt = LionCub(model.named_parameters(), lr=1e-3, aggregator=swarm)
            swarm.join(opt)
            swarm.final_step = 8
            if i == 0:  # the founder's first step comes once its group lists the newcomer
                second_thread.start()
                deadline = time.monotonic() + 30
                while second.peer_id not in swarm.history.latest.member_ids() and time.monotonic() < deadline:
                    time.sleep(0.01)
            x, y = task.shard(i, 2)
            while opt.step_count < 8:
                nn.functional.cross_entropy(model(x[:32]), y[:32]).backward()
                started = time.monotonic()
                opt.step()
                opt.zero_grad()
                step_s.setdefault(i, []).append(time.monotonic() - started)
                time.sleep(0.02)
            digests[i] = snapshot.params_digest(opt)
        except Exception as e:  # surfaced below
            errors.append(e)

    first_thread = threading.Thread(target=run, args=(0, first))
    second_thread = threading.Thread(target=run, args=(1, second))
    try:
        first_thread.start()
        first_thread.join(90)
        if second_thread.ident is not None:  # started once the founder joined
            second_thread.join(90)
        assert not errors, errors
        assert len(step_s) == 2 and max(max(s) for s in step_s.values()) < 4.0, step_s
        assert digests[0] == digests[1]
    finally:
        first.shutdown()
        second.shutdown()


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_shutdown_tells_the_group_at_once_and_leaves_no_process(caplog):
    """A peer that leaves is dropped by the leader at its next refresh (its signed "leaving" record),
    not after its record expires (30 s here) or rounds go missing, and the part the stayer reduces
    stops waiting for its vote then, not at the upload deadline (20 s here); its DHT process and
    libp2p daemon are gone when shutdown() returns; nothing is logged at ERROR level on the way out."""
    from lioncub_p2p.swarm.dht_process import alive as _alive, descendants as _descendants

    task = digits_task(0, hidden=16)
    slow_deadline = replace(FAST, upload_timeout=20.0, result_timeout=40.0)
    swarms = [Swarm(_config("leave", record_ttl=30.0, allreduce=slow_deadline))]
    swarms.append(Swarm(_config("leave", record_ttl=30.0, allreduce=slow_deadline,
                                initial_peers=swarms[0].visible_maddrs())))
    stop, errors, steps = threading.Event(), [], {}

    def run(i: int) -> None:
        try:
            model = task.make_model(0)
            opt = LionCub(model.named_parameters(), lr=1e-3, aggregator=swarms[i])
            swarms[i].join(opt, wait_peers=2, wait_timeout=60)
            x, y = task.shard(i, 2)
            while not stop.is_set() and not (i == 1 and steps.get(1, 0) >= 10):
                nn.functional.cross_entropy(model(x[:16]), y[:16]).backward()
                opt.step()
                opt.zero_grad()
                steps[i] = opt.step_count
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        threads[1].join(120)
        leaver, stayer = swarms[1], swarms[0]
        assert not errors and leaver.peer_id in stayer.history.latest.member_ids()
        processes = [leaver.dht.pid] + _descendants(leaver.dht.pid)
        assert len(processes) >= 2  # the DHT process and its p2pd
        with caplog.at_level("INFO"):
            caplog.clear()
            started = time.monotonic()
            leaver.shutdown()
            assert not [p for p in processes if _alive(p)]
            while leaver.peer_id in stayer.history.latest.member_ids() and time.monotonic() - started < 30:
                time.sleep(0.1)
            dropped_after = time.monotonic() - started
            assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], \
                [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert dropped_after < 5.0, dropped_after
        before = steps[0]
        deadline = started + 15  # < the upload deadline: the round in flight did not wait for it
        while steps[0] < before + 10 and time.monotonic() < deadline:  # the one left trains on, alone
            time.sleep(0.1)
        assert steps[0] >= before + 10 and not errors, (before, steps[0])
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        for s in swarms:
            s.shutdown()


def test_an_error_in_the_round_path_is_a_missed_round_not_an_exception():
    """What escaped optimizer.step() before (ValueError: cannot convert float NaN to integer, raised
    while building a round from a poisoned group) is now a missed round: a zero update (weight decay
    only), counted, and the next step runs normally."""
    swarm = Swarm(_config("missed"))
    try:
        model = digits_task(0, hidden=8).make_model(0)
        opt = LionCub(model.named_parameters(), lr=1e-2, weight_decay=0.1, aggregator=swarm)
        swarm.join(opt)
        x, y = digits_task(0, hidden=8).shard(0, 1)
        real_spec = swarm.book.spec

        def poisoned(*args, **kwargs):
            raise ValueError("cannot convert float NaN to integer")

        swarm.book.spec = poisoned
        before = [p.detach().clone() for p in model.parameters()]
        nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
        opt.step()  # must not raise
        assert swarm.stats.missed and swarm.missed_rounds == 1 and opt.step_count == 1
        for b, p in zip(before, model.parameters()):
            assert torch.equal(p.detach(), b * (1 - 1e-2 * 0.1))  # decoupled weight decay, no update
        swarm.book.spec = real_spec
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
        opt.step()
        assert not swarm.stats.missed and swarm.missed_rounds == 1 and opt.step_count == 2
    finally:
        swarm.shutdown()


@pytest.mark.slow
def test_by_default_a_swarm_listens_on_all_interfaces_over_tcp_and_quic():
    founder = Swarm(SwarmConfig("listen", allreduce=FAST))  # the library default: no host_maddrs given
    try:
        assert founder.config.host_maddrs == ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"]
        addresses = founder.visible_maddrs()
        assert any(a.startswith("/ip4/127.0.0.1/tcp/") for a in addresses) and all("/p2p/" in a for a in addresses)
        founder.join(LionCub(digits_task(0, hidden=8).make_model(0).named_parameters(), aggregator=founder))
        quic_only = [a for a in addresses if a.startswith("/ip4/127.0.0.1/udp/") and "/quic-v1/" in a]
        assert quic_only
        joiner = Swarm(_config("listen", initial_peers=quic_only))  # reaches the founder over QUIC alone...
        try:  # ...and is admitted by it: the exchange's last message survives the close (it lingers)
            assert joiner.history.latest is not None and joiner.history.latest.author == founder.peer_id
        finally:
            joiner.shutdown()
    finally:
        founder.shutdown()


# -- a lying reducer in a swarm: proven by audits, dropped by the leader, refused for the run ---------------

def _accuse(swarm: Swarm, to: str, accusation) -> tuple[bool, str]:
    from lioncub_p2p.swarm.accuse import send_accusation

    return swarm.loop.run(send_accusation(swarm.p2p, to, accusation), timeout=90)


def test_suspicion_needs_two_members_for_the_same_round_and_wears_off():
    from lioncub_p2p.swarm.accuse import Suspicions

    s = Suspicions(by=2, window=300.0)
    assert not s.add("r", b"round1", "a", "unanswered", now=0.0)
    assert not s.add("r", b"round2", "b", "unanswered", now=1.0)  # another round: scattered alarms never add up
    assert not s.add("r", b"round1", "a", "again", now=2.0)  # the same member twice counts once
    assert not s.add("r", b"round1", "r", "self", now=2.0)  # nor does the accused
    assert s.suspects(now=3.0) == set()
    assert s.add("r", b"round1", "c", "misrepresented", now=3.0)  # a second member, same round: suspect
    assert s.suspects(now=4.0) == {"r"} and len(s.reasons("r")) == 2
    assert s.suspects(now=303.0) == set() and s.reasons("r") == []  # worn off
    small = Suspicions(max_rounds=2)
    for i in range(5):
        small.add("r", bytes([i]), "a", "x", now=0.0)
    assert len(small._reports["r"]) == 2  # bounded memory per accused


def _member_thread(task, n: int, stop: threading.Event, steps: dict, states: dict, errors: list,
                   all_in: threading.Event, *, after_join=None):
    """The training thread of member i of n: join, wait for all n (then ``all_in``), ``after_join(swarm)``,
    step until ``stop`` or ``steps["final"]``, keeping ``steps[i]``; at the end ``states[i]`` is (step,
    parameter digest); an exception goes to ``errors`` as "i: ..."."""
    def run(i: int, swarm: Swarm) -> None:
        try:
            model = task.make_model(seed=0)
            opt = LionCub(model.named_parameters(), lr=1e-3, weight_decay=0.1, aggregator=swarm)
            swarm.join(opt, wait_peers=n, wait_timeout=90)
            all_in.set()
            if after_join is not None:
                after_join(swarm)
            x, y = task.shard(i, n)
            gen = torch.Generator().manual_seed(i)
            while not stop.is_set() and opt.step_count < steps.get("final", 10**9):
                idx = torch.randint(0, len(x), (32,), generator=gen)
                nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
                opt.zero_grad()
                steps[i] = opt.step_count
                time.sleep(0.02)
            states[i] = (opt.step_count, snapshot.params_digest(opt))
        except Exception as e:
            errors.append(f"{i}: {type(e).__name__}: {e}")

    return run


def _honest_to_final(steps: dict, swarms: list, threads: list, liar: Swarm) -> int:
    """End the run of ``_member_thread``s 10 steps past the furthest honest member; wait for the honest."""
    final = steps["final"] = max(steps.get(i, 0) for i, s in enumerate(swarms) if s is not liar) + 10
    for t, s in zip(threads, swarms):
        if s is not liar:
            t.join(120)
    return final


def _stop_members(stop: threading.Event, swarms: list, threads: list) -> None:
    stop.set()
    for s in swarms:
        s.shutdown()
    for t in threads:
        t.join(30)


def _assert_honest_end_equal(errors: list, states: dict, swarms: list, liar: Swarm, final: int) -> None:
    """Only the liar's thread may have failed; the honest ended bitwise equal at the final step."""
    assert not [e for e in errors if not e.startswith(f"{swarms.index(liar)}:")], errors
    digests = {states[i] for i, s in enumerate(swarms) if s is not liar}
    assert len(digests) == 1 and next(iter(digests))[0] == final, digests


@pytest.mark.slow
@pytest.mark.parametrize("role", ["member", "leader"])
def test_a_lying_reducer_is_dropped_by_the_leader_on_evidence_and_nobody_honest_is_ever_dropped(role):
    """Four swarm members; one flips every result it reduces (``testing.lying_reduction``): the one with
    the largest peer id (a member), or the smallest (the leader). One honest peer runs no audits of its
    own (the leader, or the third member when the liar leads), so it can only learn of the lie from
    another member's evidence on ``lioncub/accuse/1`` (forwarded to the leader; from a new leader to
    every member when the liar led). The liar is dropped and stays out; honest members train on for
    150 rounds, never leave the group, end bitwise equal; and accusations without evidence that proves
    them (the liar accusing an honest reducer with its own evidence, a lone suspicion, an outsider)
    change nothing."""
    from dataclasses import replace as dc_replace

    from lioncub_p2p.swarm.accuse import Accusation
    from lioncub_p2p.testing import lying_reduction

    task = digits_task(0, hidden=64)
    config = lambda **kw: _config("liar", momentum=MomentumSchedule(every=0), join_timeout=20.0, **kw)  # noqa: E731
    swarms = [Swarm(config())]
    swarms += [Swarm(config(initial_peers=swarms[0].visible_maddrs())) for _ in range(3)]
    by_id = sorted(swarms, key=lambda s: s.peer_id)
    if role == "member":
        leader, liar, quiet = by_id[0], by_id[-1], by_id[0]
    else:  # the liar leads; the next member takes over once it is proven
        leader, liar, quiet = by_id[1], by_id[0], by_id[2]
    honest = [s for s in swarms if s is not liar]
    # accusations' headers are checked by the verdicts (busy before the evidence travels: test_verdicts.py)
    assert all(s.accuse_server.on_header == s.verdicts.on_header for s in swarms)
    quiet.node.config = dc_replace(quiet.node.config, audits_per_round=0)  # learns only from others' evidence
    lying = lying_reduction(1.0, seed=0)
    stop, errors, steps, states = threading.Event(), [], {}, {}
    all_in = threading.Event()
    honest_dropped: list[tuple[int, list[str]]] = []  # (epoch, members) of any group without an honest peer

    def lie(swarm: Swarm) -> None:
        if swarm is liar:
            swarm.node.reduction_factory = lying

    run = _member_thread(task, 4, stop, steps, states, errors, all_in, after_join=lie)

    threads = [threading.Thread(target=run, args=(i, s), daemon=True) for i, s in enumerate(swarms)]
    honest_ids = {s.peer_id for s in honest}
    try:
        for t in threads:
            t.start()
        assert all_in.wait(120), errors
        deadline, dropped_at = time.monotonic() + 180, None
        everyone = {s.peer_id for s in swarms}
        start_epoch = min(g.epoch for g in leader.history.by_epoch.values() if everyone <= set(g.member_ids()))
        while time.monotonic() < deadline:
            for s in honest:  # every group an honest peer accepted once all were in keeps every honest peer
                for g in list(s.history.by_epoch.values()):
                    if g.epoch >= start_epoch and not honest_ids <= set(g.member_ids()) \
                            and (g.epoch, g.member_ids()) not in honest_dropped:
                        honest_dropped.append((g.epoch, g.member_ids()))
            if dropped_at is None and liar.peer_id in leader.liars and \
                    liar.peer_id not in leader.history.latest.member_ids():
                dropped_at = max(steps.get(i, 0) for i in range(4))
            if dropped_at is not None and min(steps.get(swarms.index(s), 0) for s in honest) > dropped_at + 150:
                break
            time.sleep(0.1)
        assert dropped_at is not None, (f"liar not dropped; it lied in {len(lying.lies)} rounds; leader knows "
                                        f"{leader.liars}; members {leader.history.latest.member_ids()}")
        assert "proved by" in quiet.liars[liar.peer_id] and quiet.peer_id not in quiet.liars[liar.peer_id]
        assert not quiet.node.caught  # it audited nothing: what it knows came on an accusation stream
        catcher = next(s for s in honest if liar.peer_id in s.node.caught)
        evidence = catcher.node.caught[liar.peer_id].evidence
        assert evidence and catcher is not quiet

        # accusations that prove nothing: the liar (a member of that round) accuses an honest reducer of
        # the same round with its own evidence; a lone suspicion; an outsider
        proof = catcher.node.caught[liar.peer_id]
        step = catcher.book.steps[proof.round_id]
        group, _ = catcher.book.round_of(proof.round_id, step, proof.part, liar.peer_id)
        victim = next(j for j, m in enumerate(group.members) if m.peer_id in honest_ids - {leader.peer_id}
                      and m.reduces)
        victim_id = group.members[victim].peer_id
        framed = Accusation("lie", victim_id, proof.round_id, victim, step, "framed", evidence)
        taken, note = _accuse(liar, leader.peer_id, framed)
        assert not taken and "does not prove" in note, note
        bulky = Accusation("lie", victim_id, proof.round_id, victim, step, "bulky", b"\0" * (512 << 10))
        taken, note = _accuse(liar, leader.peer_id, bulky)  # refused from its header, before any of it is read
        assert not taken and "more than such a round produces" in note, note
        taken, note = _accuse(liar, leader.peer_id, Accusation("unanswered", victim_id, proof.round_id, victim, step,
                                                               "a lone suspicion"))
        assert taken and note == "noted", note  # one member's word: noted, nothing more
        outsider = Swarm(_config("liar-outsider"))
        try:
            with pytest.raises(Exception):  # not a member of any of the leader's groups: the gate closes it
                _accuse(outsider, leader.peer_id, framed)
        finally:
            outsider.shutdown()
        time.sleep(2.0)  # a leader refresh or more

        final = _honest_to_final(steps, swarms, threads, liar)
    finally:
        _stop_members(stop, swarms, threads)
    _assert_honest_end_equal(errors, states, swarms, liar, final)
    assert not honest_dropped, honest_dropped
    for s in honest:  # nobody honest was ever accused of a proven lie, or dropped on suspicions
        assert set(s.liars) <= {liar.peer_id}, s.liars
        assert not (s.suspects() & honest_ids), s.suspicions
    assert liar.peer_id not in leader.history.latest.member_ids()


@pytest.mark.slow
def test_a_reducer_that_sends_up_other_margins_than_its_groups_counts_is_dropped_and_the_rest_end_equal():
    """Nine members, max_group 3: three groups of three. The member with the largest peer id (never
    the leader) votes every position "for" at the second level instead of its group's margins, while
    it gives its group the second level's true result. Its two group-mates recount its margins from
    its group's votes (``VoteNode._check_margins``, every round here) and send the leader (in another
    group, unless a group change under load regrouped them) the evidence (``audit.judge_margins``),
    which convicts it: it is dropped and refused for the run. Nobody honest is suspected or
    caught, and the honest members end bitwise equal at the same step."""
    allreduce = replace(FAST, audits_per_round=2, slice_audit_rate=1.0)
    config = lambda **kw: _config("margins", max_group=3, allreduce=allreduce,  # noqa: E731
                                  momentum=MomentumSchedule(every=0), join_timeout=30.0, **kw)
    task = digits_task(0, hidden=32)
    swarms = [Swarm(config())]
    swarms += [Swarm(config(initial_peers=swarms[0].visible_maddrs())) for _ in range(8)]
    by_id = sorted(swarms, key=lambda s: s.peer_id)
    leader, liar = by_id[0], by_id[-1]
    honest = [s for s in swarms if s is not liar]
    honest_ids = {s.peer_id for s in honest}
    stop, errors, steps, states, all_in = threading.Event(), [], {}, {}, threading.Event()
    run_round = liar.node.run_round

    async def lying_run_round(spec, upload, tag=b"", **kwargs):
        if spec.second_level:  # every position all for, whatever its group voted
            s = (1 << (spec.upload.bits - 1)) - 1
            upload = codecs.pack_planes(torch.full((8 * spec.nbytes,), 2 * s), spec.upload.bits)
        return await run_round(spec, upload, tag, **kwargs)

    def lie(swarm: Swarm) -> None:
        if swarm is liar:
            swarm.node.run_round = lying_run_round

    run = _member_thread(task, 9, stop, steps, states, errors, all_in, after_join=lie)

    threads = [threading.Thread(target=run, args=(i, s), daemon=True) for i, s in enumerate(swarms)]
    try:
        for t in threads:
            t.start()
            time.sleep(0.2)
        assert all_in.wait(120), errors
        deadline, dropped_at = time.monotonic() + 150, None
        while time.monotonic() < deadline and not errors:
            latest = leader.history.latest
            if dropped_at is None and liar.peer_id in leader.suspects() and liar.peer_id not in latest.member_ids():
                dropped_at = max(steps.get(swarms.index(s), 0) for s in honest)
            if dropped_at is not None and min(steps.get(swarms.index(s), 0) for s in honest) > dropped_at + 20:
                break
            time.sleep(0.1)
        catchers = [s for s in honest if liar.peer_id in s.node.caught]
        assert dropped_at is not None, (f"liar not dropped; suspects {leader.suspects()}; caught by "
                                        f"{[s.peer_id[:8] for s in catchers]}; members "
                                        f"{leader.history.latest.member_ids()}; errors {errors}")
        assert catchers and all(s.node.caught[liar.peer_id].kind == "lie"
                                and "margins" in s.node.caught[liar.peer_id].reason for s in catchers)
        assert "margins" in leader.liars[liar.peer_id]  # convicted on evidence it checked, refused for the run
        final = _honest_to_final(steps, swarms, threads, liar)
    finally:
        _stop_members(stop, swarms, threads)
    _assert_honest_end_equal(errors, states, swarms, liar, final)
    for s in honest:
        assert not (s.suspects() & honest_ids) and not set(s.node.caught) - {liar.peer_id}, s.suspicions
    assert liar.peer_id not in leader.history.latest.member_ids()  # (an honest one dropped for a slow round
    # under load may be out for a while: that is not what this test is about)


@pytest.mark.slow
def test_a_client_never_founds_a_run_it_waits_for_a_group_then_says_why():
    """A client-mode peer that finds no group must not start one (nobody could dial it to reduce:
    every round would fail and it would train alone); it waits for a group, then stops with one line.
    (A client joining a listening founder's group: test_swarm_processes.py.)"""
    from hivemind import DHT

    bootstrap = DHT(start=True, host_maddrs=LOOPBACK)
    maddrs = [str(m) for m in bootstrap.get_visible_maddrs()]
    try:
        client = Swarm(_config("lonely-client", initial_peers=maddrs, client_mode=True, join_timeout=5.0))
        try:
            started = time.monotonic()
            with pytest.raises(SwarmError, match="client mode cannot start"):
                model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
                client.join(LionCub(model.named_parameters(), lr=1e-3, aggregator=client))
            assert time.monotonic() - started >= 4.5  # it waited for a group first
            assert client.history.latest is None  # and published none
        finally:
            client.shutdown()
    finally:
        bootstrap.shutdown()


@pytest.mark.slow
def test_a_client_whose_last_reducer_left_stops_with_one_line_instead_of_missing_rounds_for_ever(monkeypatch):
    """A client-mode peer cannot count votes or lead a group: once every peer that can has left, each
    of its rounds fails. Within STRANDED_AFTER_S it says so (``swarm.stranded``, which lioncub-train
    prints as one line, exit 1), and not while the founder is still there."""
    from lioncub_p2p.swarm import pipeline

    monkeypatch.setattr(pipeline, "STRANDED_AFTER_S", 2.0)
    founder = Swarm(_config("stranded", record_ttl=3.0))
    client = Swarm(_config("stranded", initial_peers=founder.visible_maddrs(), client_mode=True))
    try:
        task = digits_task(0, hidden=16)
        models = [task.make_model(seed=0) for _ in range(2)]
        opts = [LionCub(m.named_parameters(), lr=1e-3, aggregator=s) for m, s in zip(models, (founder, client))]
        x, y = task.shard(0, 1)
        errors = []

        def train(i: int, steps: int) -> None:
            try:
                for _ in range(steps):
                    nn.functional.cross_entropy(models[i](x[:32]), y[:32]).backward()
                    opts[i].step()
                    opts[i].zero_grad()
            except Exception as e:
                errors.append(e)

        joined = [threading.Thread(target=lambda i=i, s=s: s.join(opts[i], wait_peers=2, wait_timeout=60))
                  for i, s in enumerate((founder, client))]
        for t in joined:
            t.start()
            time.sleep(0.3)
        for t in joined:
            t.join(90)
        together = [threading.Thread(target=train, args=(i, 5)) for i in range(2)]
        for t in together:
            t.start()
        for t in together:
            t.join(60)
        assert not errors and client.stranded is None and opts[1].step_count == 5
        founder.shutdown()
        deadline = time.monotonic() + 60
        while client.stranded is None and time.monotonic() < deadline:
            train(1, 1)
        assert not errors, errors
        assert client.stranded is not None and "client mode" in client.stranded, client.stranded
    finally:
        client.shutdown()
        founder.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0, 1])
def test_a_peer_too_slow_for_the_group_follows_without_holding_it_back_and_ends_equal(delay, caplog):
    """One peer computes ~10x slower than the others. Its votes stop counting, so it follows: it
    receives each result without voting and announces it; the leader gives it no part to reduce and
    reducers stop waiting for it, so the others run ahead of it instead of at its pace; it still
    applies every result (or skips ahead by downloading the state) and all four end bitwise equal.
    Overlapped, the slow peer is the founder and announces a tiny bandwidth weight: it leads alone
    until others are synced (the weight floor never leaves a group without a reducer), then gets no
    part (below a tenth of the median), and the peers still start together (``join(wait_peers=...)``)."""
    seen, slow = {}, 0 if delay else 3
    # overlapped, with momentum streamed every step (the default) the others ran only 5-8 steps ahead of
    # the slow founder (not understood yet): this case keeps whole-buffer syncs every 20 steps
    momentum = MomentumSchedule(every=20) if delay else None
    configs = [_config(f"follow{delay}", delay=delay, weight=0.05 if delay and i == slow else 1.0, momentum=momentum)
               for i in range(4)]
    with caplog.at_level(logging.INFO, logger="lioncub_p2p.swarm"):
        out = _train_swarm(configs, 60, slow=(slow, 0.3), instrument=lambda i, s: seen.setdefault(i, s))
    assert {out[i][0] for i in range(4)} == {60}
    assert len({out[i][1] for i in range(4)}) == 1 and len({out[i][3] for i in range(4)}) == 1
    followed = out.get("followed", {})
    assert len(followed.get(slow, [])) >= 10, followed  # the slow peer followed many rounds...
    assert set(followed) == {slow}, followed  # ...and only it
    assert out["max_lead"] >= 10  # the others ran ahead instead of waiting for it every step
    slow_id = seen[slow].peer_id
    groups = [seen[(slow + 1) % 4].history.for_step(s) for s in followed[slow]]
    weights = {m.weight for g in groups if g is not None for m in g.members if m.peer_id == slow_id}
    assert 0.0 in weights, weights  # the leader took its part away while it followed (a few steps on)
    assert "following (results only, no votes)" in caplog.text
