"""lioncub-train: a volunteer peer training the digits example with the swarm.

    lioncub-train --run-id demo --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...

Behind NAT (nobody can dial you) add --client-mode: you vote and receive every result but reduce
nothing. Ctrl+C leaves the run cleanly.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
from torch import nn

from .. import LionCub, MomentumSchedule
from ..allreduce import AllReduceConfig
from ..sim.tasks import digits_task
from ..swarm import Swarm, SwarmConfig, SwarmError
from ..swarm import snapshot
from .common import read_peers_file, setup_logging

logger = logging.getLogger("lioncub.train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-id", default="demo")
    p.add_argument("--initial-peers", nargs="*", default=[], help="coordinators' multiaddrs")
    p.add_argument("--initial-peers-file", default=None)
    p.add_argument("--host-maddrs", nargs="+", default=["/ip4/127.0.0.1/tcp/0"])
    p.add_argument("--announce-maddrs", nargs="*", default=[])
    p.add_argument("--identity-path", default=None)
    p.add_argument("--client-mode", action="store_true", help="behind NAT: dial out only")
    p.add_argument("--weight", type=float, default=1.0, help="share of reduction work (e.g. your upload Mbit/s)")
    p.add_argument("--run-secret", default=None, help="the run's shared secret, if it has one (admission)")
    p.add_argument("--allow-peers", nargs="*", default=[], help="admit only these peer ids")
    p.add_argument("--steps", type=int, default=1000, help="stop at this global step")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=256, help="hidden width of the example MLP")
    p.add_argument("--method", default="lioncub", choices=["lioncub", "dlion", "hivemind-fp32", "hivemind-fp16"],
                   help="lioncub: butterfly vote; dlion: all-gather of votes; hivemind-*: full-precision "
                        "gradient averaging with hivemind's DecentralizedAverager (baselines)")
    p.add_argument("--group-size", type=int, default=0, help="hivemind baselines: peers per averaging group")
    p.add_argument("--max-seconds", type=float, default=0.0, help="also stop after this many seconds of training")
    p.add_argument("--eval-every", type=int, default=0, help="log test loss every this many steps")
    p.add_argument("--wait-peers", type=int, default=0, help="start training once this many peers are in the group")
    p.add_argument("--final-eval", default=None, help="write final test loss/accuracy (JSON) here")
    p.add_argument("--upload", default="sign", help="sign | l1:BITS")
    p.add_argument("--result", default="majority", help="majority | ternary | mean")
    p.add_argument("--momentum-every", type=int, default=20, help="momentum averaging period (0: never)")
    p.add_argument("--upload-timeout", type=float, default=10.0)
    p.add_argument("--result-timeout", type=float, default=20.0)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--metrics-jsonl", default=None, help="append one JSON line per step")
    p.add_argument("--tensorboard", default=None, help="also log metrics to this TensorBoard directory")
    p.add_argument("--final-state", default=None, help="write the final snapshot here (tests compare them)")
    p.add_argument("--step-delay", type=float, default=0.0, help="extra seconds per step (simulate slow compute)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar; a log line every 50 steps")
    p.add_argument("--preflight", action="store_true",
                   help="check coordinators, reachability, bandwidth and round time, then exit")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.quiet)
    torch.set_num_threads(1)  # volunteers share machines; the example is small
    task = digits_task(seed=0, hidden=args.hidden)
    model = task.make_model(seed=args.seed)
    if args.method.startswith("hivemind"):
        from ..sim.baselines import train_with_hivemind_averager

        return train_with_hivemind_averager(args, task, model)
    allreduce = allreduce_config(args.upload_timeout, args.result_timeout)
    config = SwarmConfig(args.run_id, initial_peers=args.initial_peers + read_peers_file(args.initial_peers_file),
                         host_maddrs=args.host_maddrs, announce_maddrs=args.announce_maddrs,
                         identity_path=args.identity_path, client_mode=args.client_mode, weight=args.weight,
                         run_secret=args.run_secret, allow_peers=args.allow_peers,
                         upload=args.upload, result=args.result, allreduce=allreduce,
                         transport="allgather" if args.method == "dlion" else "butterfly",
                         momentum=MomentumSchedule(every=args.momentum_every), checkpoint_dir=args.checkpoint_dir,
                         checkpoint_every=args.checkpoint_every if args.checkpoint_dir else 0)
    if args.preflight:
        from .preflight import preflight

        raise SystemExit(preflight(args, config, task, model))
    try:
        swarm = Swarm(config)
    except SwarmError as e:
        raise SystemExit(f"error: {e}")
    optimizer = LionCub(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, aggregator=swarm,
                        upload=args.upload)
    metrics = open(args.metrics_jsonl, "a") if args.metrics_jsonl else None
    board = _tensorboard(args.tensorboard)
    try:
        start_step = swarm.join(optimizer)
        if args.wait_peers:
            swarm.wait_for_peers(args.wait_peers)
            start_step = optimizer.step_count
        logger.info("training from step %d as %s%s", start_step, swarm.peer_id, " (client mode)" * args.client_mode)
        train(args, task, model, optimizer, swarm, metrics, board)
    except KeyboardInterrupt:
        print(f"\nleft the run at step {optimizer.step_count}", flush=True)
    except SwarmError as e:
        raise SystemExit(f"error: {e}")
    except (MemoryError, torch.OutOfMemoryError) as e:
        raise SystemExit(f"error: out of memory ({type(e).__name__}): lower --batch or --hidden, or close other "
                         f"programs; the run goes on without you and you can rejoin")
    finally:
        if args.final_state:
            Path(args.final_state).write_bytes(snapshot.encode(optimizer)[0])
        if metrics:
            metrics.close()
        if board is not None:
            board.close()
        swarm.shutdown()


def allreduce_config(upload_timeout: float, result_timeout: float) -> AllReduceConfig:
    """The round timeouts a trainer runs with: joins and recoveries wait at most 5 s (or the upload timeout)."""
    short = min(5.0, upload_timeout)
    return AllReduceConfig(upload_timeout=upload_timeout, result_timeout=result_timeout, join_timeout=short,
                           recovery_timeout=short)


def _tensorboard(logdir: str | None):
    if not logdir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise SystemExit("error: --tensorboard needs the tensorboard package: pip install 'lioncub-p2p[tensorboard]'")
    return SummaryWriter(logdir)


def train(args, task, model, optimizer: LionCub, swarm: Swarm, metrics, board=None) -> None:
    from tqdm import tqdm

    x, y = task.x_train, task.y_train
    gen = torch.Generator().manual_seed(int.from_bytes(swarm.peer_id.encode()[-6:], "big"))
    swarm.samples_per_step = args.batch
    bar = None if args.quiet else tqdm(total=args.steps, initial=optimizer.step_count, unit="step", dynamic_ncols=True)
    started = time.monotonic()
    while optimizer.step_count < args.steps and not (args.max_seconds and time.monotonic() - started > args.max_seconds):
        t0 = time.perf_counter()
        idx = torch.randint(0, len(x), (args.batch,), generator=gen)
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        if args.step_delay:
            time.sleep(args.step_delay)
        t1 = time.perf_counter()
        before = optimizer.step_count
        optimizer.step()
        optimizer.zero_grad()
        t2 = time.perf_counter()
        stats = swarm.stats
        swarm.last_loss = loss.item()
        record = dict(step=before, loss=loss.item(), peers=stats.peers, group=stats.group_size,
                      bytes_up=stats.bytes_up, bytes_down=stats.bytes_down, bits_per_param=stats.bits_per_param,
                      compute_s=t1 - t0, step_s=t2 - t1, wait_s=stats.wait_s, round_s=stats.round_s,
                      aggregate_s=stats.seconds, repaired=stats.repaired,
                      momentum_synced=stats.momentum_synced, time=time.time())
        if args.eval_every and optimizer.step_count % args.eval_every == 0:
            record["eval_loss"] = task.evaluate(model)[0]
        if metrics:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if board is not None:
            for key in ("loss", "eval_loss", "peers", "bits_per_param", "compute_s", "step_s", "wait_s", "bytes_up",
                        "bytes_down"):
                if key in record:
                    board.add_scalar(key, record[key], before)
        compute, wait = t1 - t0, stats.wait_s
        comm = max(t2 - t1 - wait, 0.0)  # the optimizer step minus the time spent waiting for others
        if bar is not None:
            bar.update(optimizer.step_count - before)
            seconds = max(stats.seconds, 1e-6)
            bar.set_postfix(peers=f"{stats.peers}/{stats.group_size}", loss=f"{loss.item():.3f}",
                            up=f"{stats.bytes_up / seconds / 1e6:.2f}MB/s", down=f"{stats.bytes_down / seconds / 1e6:.2f}MB/s",
                            bits=f"{stats.bits_per_param:.2f}",
                            time=f"{compute:.2f}c/{comm:.2f}m/{wait:.2f}w")
        elif optimizer.step_count % 50 == 0:
            logger.info("step %d loss %.3f peers %d/%d %.2f bits/param, s compute/comm/wait %.2f/%.2f/%.2f",
                        optimizer.step_count, loss.item(), stats.peers, stats.group_size, stats.bits_per_param,
                        compute, comm, wait)
    if bar is not None:
        bar.close()
    finish(args, task, model, optimizer.step_count)


def finish(args, task, model, step: int) -> None:
    loss, acc = task.evaluate(model)
    print(f"finished at step {step}: test loss {loss:.3f}, accuracy {acc:.1f}%", flush=True)
    if args.final_eval:
        Path(args.final_eval).write_text(json.dumps({"step": step, "eval_loss": loss, "eval_accuracy": acc}))


if __name__ == "__main__":
    main()
