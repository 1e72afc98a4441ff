"""The full-precision baseline: hivemind's own butterfly all-reduce (``DecentralizedAverager``).

Configured as ``../shared/docs/hivemind.md`` recommends for a fair comparison: a full group every
step (target and minimum group size = n), and timeouts set, since its defaults wait forever on a
dead peer. Averages a float vector in float32 or float16 on the wire.
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


def train_with_hivemind_averager(args, task, model) -> None:
    """The full-precision data-parallel baseline as a volunteer would run it: every step, gradients
    are averaged with hivemind's butterfly all-reduce (a full group, timeouts set), then plain Lion.

    Used by ``lioncub-train --method hivemind-fp32|hivemind-fp16`` (the simulator's method 3).
    Every peer starts from the same initialization (``--seed``), so identical averaged gradients keep
    the replicas equal; a failed round falls back to the local gradient and is counted."""
    import json
    from pathlib import Path

    from hivemind import DHT
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import Float16Compression, NoCompression
    from torch import nn

    from ..cli.common import read_peers_file
    from ..cli.train import finish
    from ..optim import LionCub

    dht = DHT(start=True, initial_peers=args.initial_peers + read_peers_file(args.initial_peers_file),
              host_maddrs=args.host_maddrs, announce_maddrs=args.announce_maddrs or None,
              client_mode=args.client_mode, no_listen=args.client_mode, nat_port_map=False, auto_nat=False)
    grads = [torch.zeros_like(p) for p in model.parameters()]
    group = args.group_size or 2
    averager = DecentralizedAverager(
        grads, dht, start=True, prefix=f"{args.run_id}_grads", target_group_size=group, min_group_size=group,
        min_matchmaking_time=2.0, request_timeout=1.0, next_chunk_timeout=args.upload_timeout,
        sender_timeout=args.upload_timeout, reducer_timeout=args.result_timeout,
        allreduce_timeout=4 * args.result_timeout, client_mode=args.client_mode,
        compression=Float16Compression() if args.method == "hivemind-fp16" else NoCompression())
    optimizer = LionCub(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    metrics = open(args.metrics_jsonl, "a") if args.metrics_jsonl else None
    gen = torch.Generator().manual_seed(int.from_bytes(dht.peer_id.to_base58().encode()[-6:], "big"))
    started, failures = time.monotonic(), 0
    try:
        while optimizer.step_count < args.steps and not (args.max_seconds and time.monotonic() - started > args.max_seconds):
            t0 = time.perf_counter()
            idx = torch.randint(0, len(task.x_train), (args.batch,), generator=gen)
            loss = nn.functional.cross_entropy(model(task.x_train[idx]), task.y_train[idx])
            loss.backward()
            t1 = time.perf_counter()
            with averager.get_tensors() as tensors:
                for tensor, p in zip(tensors, model.parameters()):
                    tensor.copy_(p.grad)
            try:
                ok = averager.step(timeout=args.result_timeout) is not None
            except Exception:
                ok = False
            if ok:
                with averager.get_tensors() as tensors:
                    for tensor, p in zip(tensors, model.parameters()):
                        p.grad.copy_(tensor)
            failures += not ok
            optimizer.step()
            optimizer.zero_grad()
            t2 = time.perf_counter()
            record = dict(step=optimizer.step_count - 1, loss=loss.item(), compute_s=t1 - t0, step_s=t2 - t1, wait_s=0.0,
                          averaged=ok, failures=failures, time=time.time())
            if args.eval_every and optimizer.step_count % args.eval_every == 0:
                record["eval_loss"] = task.evaluate(model)[0]
            if metrics:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
        finish(args, task, model, optimizer.step_count)
        if args.final_state:
            from ..swarm import snapshot

            Path(args.final_state).write_bytes(snapshot.encode(optimizer)[0])
    finally:
        if metrics:
            metrics.close()
        averager.shutdown()
        dht.shutdown()
