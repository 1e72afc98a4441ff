"""Run a few swarm peers in threads of this process, on 127.0.0.1: the examples' "local swarm".

Real DHT, real libp2p daemons, real votes: exactly what volunteers run, minus the internet.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from lioncub_p2p.allreduce import AllReduceConfig
from lioncub_p2p.swarm import Swarm, SwarmConfig

LOCAL = ["/ip4/127.0.0.1/tcp/0"]  # one machine: nobody else needs to dial these peers
LOOPBACK = AllReduceConfig(upload_timeout=3.0, result_timeout=6.0, join_timeout=2.0, recovery_timeout=2.0)


def run_local_swarm(peers: int, train: Callable[[int, Swarm], object], run_id: str = "example") -> list[object]:
    """Start ``peers`` swarms on loopback and call ``train(index, swarm)`` for each in its own thread;
    returns what each call returned (in peer order). Every swarm is shut down at the end."""
    first = Swarm(SwarmConfig(run_id, host_maddrs=LOCAL, allreduce=LOOPBACK))
    maddrs = [str(m) for m in first.dht.get_visible_maddrs()]
    swarms = [first] + [Swarm(SwarmConfig(run_id, initial_peers=maddrs, host_maddrs=LOCAL, allreduce=LOOPBACK)) for _ in range(peers - 1)]
    results: list[object] = [None] * peers
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = train(i, swarms[i])
        except BaseException as e:  # re-raised below in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(peers)]
    try:
        for t in threads:
            t.start()
            time.sleep(0.2)
        for t in threads:
            t.join()
    finally:
        for s in swarms:
            s.shutdown()
    if errors:
        raise errors[0]
    return results
