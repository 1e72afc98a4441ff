"""The DHT process: a start that hangs is killed with its libp2p daemon and tried again."""
from __future__ import annotations

import asyncio
import os
import time

import pytest
from hivemind.dht.node import DHTNode

from lioncub_p2p.swarm.dht_process import alive, start_dht, stop_dht


@pytest.mark.slow
def test_a_dht_start_that_hangs_is_killed_with_its_daemon_and_tried_again(tmp_path, monkeypatch):
    hung = tmp_path / "hung"  # one line per hung start: the DHT process's pid and its daemon's
    original = DHTNode.create

    async def create(*args, **kwargs):  # runs in the forked DHT process
        node = await original(*args, **kwargs)
        starts = hung.read_text().splitlines() if hung.exists() else []
        if len(starts) < 2:  # the first two starts hang once their daemon is up
            hung.write_text("".join(f"{line}\n" for line in starts) + f"{os.getpid()} {node.p2p._child.pid}\n")
            await asyncio.sleep(3600)
        return node

    monkeypatch.setattr(DHTNode, "create", create)
    kwargs = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False)

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not start in 8 s, 1 times"):
        start_dht(timeout=8, tries=1, **kwargs)
    assert 8 <= time.monotonic() - t0 < 20

    dht = start_dht(timeout=8, tries=2, **kwargs)  # the second start hangs, the third is healthy
    try:
        assert dht.get_visible_maddrs(), "the started DHT listens"
        pids = [int(pid) for line in hung.read_text().splitlines() for pid in line.split()]
        assert len(pids) == 4, "two starts hung, each with a DHT process and a daemon"
        assert not [pid for pid in pids if alive(pid)], "a hung start's processes were left running"
    finally:
        stop_dht(dht)
