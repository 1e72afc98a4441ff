"""``lioncub-train --method hivemind-fp32|hivemind-fp16``: the full-precision data-parallel baseline
as a volunteer would run it (the simulator's comparison runs it as one of its methods).

Every step, gradients are averaged with hivemind's butterfly all-reduce (``DecentralizedAverager``:
a full group, timeouts set, since its defaults wait forever on a dead peer), then plain Lion steps.
Every peer starts from the same initialization (``--seed``), so identical averaged gradients keep
the replicas equal; a failed round falls back to the local gradient and is counted.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ..optim import LionCub
from ..swarm import snapshot
from ..tasks import TrainingTask
from .lifecycle import Interrupted, StopSignals
from .evaluation import evaluate_into, finish

logger = logging.getLogger("lioncub.train")


def train_with_hivemind_averager(args, settings, task: TrainingTask,
                                 batches_for: Callable[[torch.Generator], Iterator], initial_peers: list[str],
                                 stop: StopSignals) -> None:
    """``settings``: the trainer's ``train.Settings`` (lr, weight decay, batch), from its flags."""
    from hivemind import DHT
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import Float16Compression, NoCompression

    model = task.model
    # hivemind's averager ends its streams right after the last write, which loses that write over QUIC
    tcp_only = [m for m in args.host_maddrs if "/quic" not in m] or args.host_maddrs
    dht = DHT(start=True, initial_peers=initial_peers, host_maddrs=tcp_only,
              announce_maddrs=args.announce_maddrs or None, client_mode=args.client_mode,
              no_listen=args.client_mode, nat_port_map=False, auto_nat=False)
    averager = None
    optimizer = LionCub(model.named_parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    metrics = open(args.metrics_jsonl, "a") if args.metrics_jsonl else None
    try:
        grads = [torch.zeros_like(p) for p in model.parameters()]
        group = args.group_size or 2
        averager = DecentralizedAverager(
            grads, dht, start=True, prefix=f"{args.run_id}_grads", target_group_size=group, min_group_size=group,
            min_matchmaking_time=2.0, request_timeout=1.0, next_chunk_timeout=args.upload_timeout,
            sender_timeout=args.upload_timeout, reducer_timeout=args.result_timeout,
            allreduce_timeout=4 * args.result_timeout, client_mode=args.client_mode,
            compression=Float16Compression() if args.method == "hivemind-fp16" else NoCompression())
        gen = torch.Generator().manual_seed(int.from_bytes(dht.peer_id.to_base58().encode()[-6:], "big"))
        batches = batches_for(gen)
        started, failures = time.monotonic(), 0
        while optimizer.step_count < args.steps and not stop.requested \
                and not (args.max_seconds and time.monotonic() - started > args.max_seconds):
            with stop.deferred():
                t0 = time.perf_counter()
                batch = next(batches, None)
                if batch is None:
                    print(f"the task's data ran out at step {optimizer.step_count}", flush=True)
                    break
                loss = task.loss(model, batch)
                loss.backward()
                t1 = time.perf_counter()
                with averager.get_tensors() as tensors:
                    for tensor, p in zip(tensors, model.parameters()):
                        tensor.copy_(p.grad)
                try:
                    ok = _average(averager, args.result_timeout, stop)
                except Interrupted:
                    raise
                except Exception as e:
                    logger.debug("averaging round failed: %s", e)
                    ok = False
                if ok:
                    with averager.get_tensors() as tensors:
                        for tensor, p in zip(tensors, model.parameters()):
                            p.grad.copy_(tensor)
                failures += not ok
                optimizer.step()
                optimizer.zero_grad()
                t2 = time.perf_counter()
                record = dict(step=optimizer.step_count - 1, loss=loss.item(), compute_s=t1 - t0, step_s=t2 - t1,
                              wait_s=0.0, averaged=ok, failures=failures, time=time.time())
                if args.eval_every and optimizer.step_count % args.eval_every == 0:
                    evaluate_into(record, task)
                if metrics:
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
        if not stop.requested:
            finish(args.final_eval, task, optimizer.step_count)
    except Interrupted:
        pass
    finally:
        stop.leaving()
        if stop.requested:
            print(f"left the run at step {optimizer.step_count} ({stop.received})", flush=True)
        if args.final_state:
            Path(args.final_state).write_bytes(snapshot.encode(optimizer)[0])
        if metrics:
            metrics.close()
        if averager is not None:
            averager.shutdown()
        dht.shutdown()


def _average(averager, timeout: float, stop: StopSignals) -> bool:
    """One averaging round. A stop signal ends the wait: hivemind's matchmaking alone may take the
    whole timeout when the other peers have already left."""
    control = averager.step(timeout=timeout, wait=False)
    while not control.done():
        if stop.requested:
            control.cancel()
            return False
        time.sleep(0.05)
    return control.result() is not None
