"""Swarm.linger (closing.RunEnd.linger): after the last step, how long a peer stays for peers behind (no
network: the records and the state server are stand-ins)."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from lioncub_p2p.swarm import Swarm
from lioncub_p2p.swarm.closing import RunEnd
from lioncub_p2p.swarm.membership import PeerRecord
from lioncub_p2p.swarm.state_transfer import download_bound


def _finished_swarm(records: dict, server) -> Swarm:
    """A Swarm at its last step (10), with ``records`` as what the DHT says of the others."""
    swarm = Swarm.__new__(Swarm)
    swarm._closed = False
    swarm.optimizer = SimpleNamespace(step_count=10, slots=[], buffer_bytes=0)
    swarm.end = RunEnd(peer_id="me", loop=SimpleNamespace(run=lambda coro, timeout: asyncio.run(coro)),
                       upkeep=SimpleNamespace(records=records, announce=lambda: asyncio.sleep(0)),
                       state=SimpleNamespace(server=server), refresh_period=0.02)
    return swarm


def _record(pid: str, step: int) -> PeerRecord:
    return PeerRecord(pid, 1.0, False, step, 4, True)


def _linger(swarm: Swarm, seconds: float) -> float:
    start = time.monotonic()
    swarm.linger(seconds)
    return time.monotonic() - start


def test_nobody_behind_returns_at_once_and_one_behind_is_waited_for_until_the_bound(monkeypatch):
    idle = SimpleNamespace(uploading=False)
    assert _linger(_finished_swarm({"a": _record("a", 10)}, idle), 5.0) < 0.5
    assert 0.3 <= _linger(_finished_swarm({"a": _record("a", 10), "b": _record("b", 4)}, idle), 0.3) < 1.0


def test_a_download_under_way_is_not_cut_at_the_bound_but_is_at_its_own(monkeypatch):
    """A peer behind downloads the final state over a slow link: the lingering donor stays past
    ``seconds`` while the download runs, then leaves when it ends; and never past the time a whole
    state takes at 1 Mbit/s."""
    server = SimpleNamespace(uploading=True)
    swarm = _finished_swarm({"a": _record("a", 10), "b": _record("b", 4)}, server)
    threading.Timer(0.8, lambda: setattr(server, "uploading", False)).start()
    assert 0.8 <= _linger(swarm, 0.2) < 1.5  # 0.2 s of linger, the download ran for 0.8 s

    monkeypatch.setattr("lioncub_p2p.swarm.closing.download_bound", lambda max_bytes, wait_s: 0.5)
    server.uploading = True  # a download that never ends
    assert 0.7 <= _linger(swarm, 0.2) < 1.2  # 0.2 + its bound, 0.5
    assert download_bound(22_000_000, 0.0) == 176.0  # the real bound: 22 MB at 1 Mbit/s
