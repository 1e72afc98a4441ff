"""The full-precision baseline: hivemind's own butterfly all-reduce (``DecentralizedAverager``), n
peers in one process (benchmarks). Trainer processes run it through ``lioncub-train --method
hivemind-fp32|hivemind-fp16`` (``lioncub_p2p/cli/baseline.py``).

Configured for a fair comparison: a full group every step (target and minimum group size = n),
and timeouts set, since its defaults wait forever on a dead peer. Averages a float vector in
float32 or float16 on the wire.
"""
from __future__ import annotations

import time

import torch


class HivemindAllReduce:
    """n hivemind averager peers in this process, each averaging its own copy of a float vector."""

    def __init__(self, n: int, numel: int, *, wire_dtype: str = "float32", prefix: str = "lioncub-baseline",
                 timeout: float = 60.0):
        from hivemind import DHT
        from hivemind.averaging import DecentralizedAverager
        from hivemind.compression import Float16Compression, NoCompression

        if wire_dtype not in ("float32", "float16"):
            raise ValueError(f"wire_dtype must be float32 or float16, got {wire_dtype}")
        compression = Float16Compression() if wire_dtype == "float16" else NoCompression()
        self.timeout = timeout
        self.dhts, self.averagers = [], []
        for i in range(n):
            initial = [str(m) for m in self.dhts[0].get_visible_maddrs()] if self.dhts else []
            dht = DHT(start=True, initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False,
                      auto_nat=False)
            self.dhts.append(dht)
            tensor = torch.randn(numel, generator=torch.Generator().manual_seed(i))
            self.averagers.append(DecentralizedAverager(
                [tensor], dht, start=True, prefix=prefix, target_group_size=n, min_group_size=n,
                min_matchmaking_time=2.0, request_timeout=1.0, next_chunk_timeout=10.0, sender_timeout=10.0,
                reducer_timeout=20.0, allreduce_timeout=timeout, compression=compression))

    def step(self) -> float:
        """One averaging round on every peer at once; wall seconds until the last one finished."""
        start = time.perf_counter()
        controls = [a.step(wait=False, timeout=self.timeout) for a in self.averagers]
        results = [c.result(timeout=self.timeout + 10) for c in controls]
        if any(r is None for r in results):
            raise RuntimeError("a hivemind averaging round failed")
        return time.perf_counter() - start

    def close(self) -> None:
        for averager in self.averagers:
            averager.shutdown()
        for dht in self.dhts:
            dht.shutdown()

    def __enter__(self) -> "HivemindAllReduce":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
