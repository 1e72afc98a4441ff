"""lioncub-train: a volunteer peer that trains the run's model with the swarm, no code to write.

    lioncub-train --run-id demo --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...
    lioncub-train --task byte-gpt ...                  # a built-in task: digits (default) or byte-gpt
    lioncub-train --task mytask:make_task ...          # your own: see lioncub_p2p/tasks/__init__.py

Listens on every interface (TCP and QUIC) and prints which of its addresses others can dial.
Behind NAT (nobody can dial you) add --client-mode: you vote and receive every result but reduce
nothing. Ctrl+C or SIGTERM leaves the run cleanly after the current step (a second one at once).
Settings are checked before joining: a mistake ends in one line saying what to change.
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .. import LionCub, MomentumSchedule
from ..swarm import Swarm, SwarmConfig, SwarmError, snapshot
from ..tasks import BUILTIN, TaskError, TrainingTask, load_task
from ..trainer_rounds import allreduce_config
from .addresses import LISTEN_ALL, check_listen, check_peers, reachability
from .checks import (VOTE_RESULTS, VOTE_UPLOADS, check_checkpoint_fits, check_codecs, check_run_id,
                     check_writable_dir, check_writable_file)
from .common import HelpFormatter, UsageError, read_peers_file, setup_logging
from .lifecycle import ChildReaper, Interrupted, StopSignals

logger = logging.getLogger("lioncub.train")
HIDDEN = argparse.SUPPRESS  # options for tests and the simulator, left out of --help


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lioncub-train", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    run = p.add_argument_group("the run")
    run.add_argument("--run-id", default="demo", help="name of the run to join (no dots)")
    run.add_argument("--initial-peers", nargs="*", default=[],
                     help="coordinators' multiaddrs, as they print them: /ip4/IP/tcp/PORT/p2p/PEER_ID")
    run.add_argument("--initial-peers-file", default=None, help="read --initial-peers from this file (waits for it)")
    run.add_argument("--run-secret", default=None, help="the run's shared secret, if it has one (admission)")
    run.add_argument("--allow-peers", nargs="*", default=[], help="admit only these peer ids")
    run.add_argument("--preflight", action="store_true",
                     help="check coordinators, reachability, bandwidth and round time, then exit")

    net = p.add_argument_group("network")
    net.add_argument("--host-maddrs", nargs="+", default=LISTEN_ALL,
                     help="where to listen (every interface, TCP and QUIC, ports chosen by the OS)")
    net.add_argument("--announce-maddrs", nargs="*", default=[],
                     help="addresses others should dial, e.g. /ip4/PUBLIC_IP/tcp/PORT with a forwarded port")
    net.add_argument("--client-mode", action="store_true",
                     help="behind NAT: dial out only; you vote and get every result but reduce nothing")
    net.add_argument("--weight", type=float, default=1.0, help="share of reduction work (e.g. your upload Mbit/s)")
    net.add_argument("--identity-path", default=None, help="private key file: keeps this peer's id across restarts")

    what = p.add_argument_group("what to train")
    what.add_argument("--task", default="digits",
                      help=f"a built-in task ({', '.join(BUILTIN)}) or module:function returning "
                           f"(model, data, loss[, evaluate]); see the README's 'Bring your own model'")
    what.add_argument("--hidden", type=int, default=None,
                      help="width of a built-in model: digits' hidden units (256), byte-gpt's embedding (128)")
    what.add_argument("--seed", type=int, default=0, help="initializes the model")
    what.add_argument("--steps", type=int, default=1000, help="stop at this global step")
    what.add_argument("--max-seconds", type=float, default=0.0, help="also stop after this many seconds (0: no limit)")
    what.add_argument("--batch", type=int, default=32, help="samples per step on this peer")
    what.add_argument("--lr", type=float, default=3e-4, help="Lion's learning rate")
    what.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay")
    what.add_argument("--wait-peers", type=int, default=0,
                      help="start training once this many peers are in the group (0: at once)")

    proto = p.add_argument_group("protocol (every peer of a run uses the same)")
    proto.add_argument("--method", default="lioncub", choices=["lioncub", "dlion", "hivemind-fp32", "hivemind-fp16"],
                       help="lioncub: butterfly vote; dlion: all-gather of votes; hivemind-*: full-precision "
                            "gradient averaging with hivemind's DecentralizedAverager (baselines)")
    proto.add_argument("--upload", default="sign", help=f"vote encoding: {VOTE_UPLOADS}")
    proto.add_argument("--result", default="majority", help=f"result encoding: {' | '.join(VOTE_RESULTS)}")
    proto.add_argument("--momentum-every", type=int, default=20, help="momentum averaging period in steps (0: never)")
    proto.add_argument("--upload-timeout", type=float, default=10.0, help="seconds a reducer waits for votes")
    proto.add_argument("--result-timeout", type=float, default=20.0,
                       help="seconds a voter waits for results (more than --upload-timeout)")
    proto.add_argument("--group-size", type=int, default=0, help="hivemind baselines: peers per averaging group (0: 2)")

    out = p.add_argument_group("output")
    out.add_argument("--checkpoint-dir", default=None, help="resume from and save checkpoints in this folder")
    out.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    out.add_argument("--metrics-jsonl", default=None, help="append one JSON line per step (lioncub-plot reads it)")
    out.add_argument("--tensorboard", default=None, help="also log metrics to this TensorBoard directory")
    out.add_argument("--eval-every", type=int, default=0, help="evaluate every this many steps (0: at the end only)")
    out.add_argument("--quiet", action="store_true", help="no progress bar; a log line every 50 steps")

    p.add_argument("--final-state", default=None, help=HIDDEN)  # the final snapshot (tests compare them)
    p.add_argument("--final-eval", default=None, help=HIDDEN)  # the final evaluation as JSON (the simulator)
    p.add_argument("--step-delay", type=float, default=0.0, help=HIDDEN)  # extra seconds per step (slow compute)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.quiet)
    torch.set_num_threads(1)  # volunteers share machines; the built-in tasks are small
    with StopSignals() as stop, ChildReaper() as reaper:
        try:
            code = run(args, stop)
        except Interrupted:
            code = 0  # stopped before joining: nothing to leave
            print(f"stopped before joining the run ({stop.received})", flush=True)
        except (UsageError, TaskError, SwarmError, snapshot.SnapshotError) as e:
            raise SystemExit(f"error: {e}")
        except (MemoryError, torch.OutOfMemoryError) as e:
            raise SystemExit(f"error: out of memory ({type(e).__name__}): lower --batch or --hidden, or close other "
                             f"programs; the run goes on without you and you can rejoin")
        finally:
            stop.leaving()
            if reaper.reap():
                logger.warning("ended child processes left after the shutdown: %s", ", ".join(reaper.reaped))
    if code:
        raise SystemExit(code)


def run(args: argparse.Namespace, stop: StopSignals) -> int:
    """Check everything, then train (or run the preflight); returns the exit code."""
    initial_peers = check_settings(args)
    task = load_task(args.task, seed=args.seed, batch=args.batch, hidden=args.hidden)
    try:
        batches_for = task.checked_batches(args.batch)
    except TaskError as e:
        raise UsageError(f"--task {args.task}: {e}") from None
    if args.checkpoint_dir:  # a checkpoint of another model: one line now, not a SnapshotError after joining
        check_checkpoint_fits(args.checkpoint_dir, LionCub(task.model.parameters(), lr=args.lr, upload=args.upload),
                              hint="--task and --hidden")
    if args.method.startswith("hivemind"):
        from .baseline import train_with_hivemind_averager

        train_with_hivemind_averager(args, task, batches_for, initial_peers, stop)
        return 0
    config = SwarmConfig(args.run_id, initial_peers=initial_peers,
                         host_maddrs=args.host_maddrs, announce_maddrs=args.announce_maddrs,
                         identity_path=args.identity_path, client_mode=args.client_mode, weight=args.weight,
                         run_secret=args.run_secret, allow_peers=args.allow_peers,
                         upload=args.upload, result=args.result,
                         allreduce=allreduce_config(args.upload_timeout, args.result_timeout),
                         transport="allgather" if args.method == "dlion" else "butterfly",
                         momentum=MomentumSchedule(every=args.momentum_every), checkpoint_dir=args.checkpoint_dir,
                         checkpoint_every=args.checkpoint_every if args.checkpoint_dir else 0)
    if args.preflight:
        from .preflight import preflight

        return preflight(args, config, task, batches_for)
    swarm = Swarm(config)
    optimizer = LionCub(task.model.parameters(), lr=args.lr, weight_decay=args.weight_decay, aggregator=swarm,
                        upload=args.upload)
    metrics = board = None
    try:
        for line in reachability([str(m) for m in swarm.dht.get_visible_maddrs()], client_mode=args.client_mode):
            print(line, flush=True)
        metrics = open(args.metrics_jsonl, "a") if args.metrics_jsonl else None
        board = _tensorboard(args.tensorboard)
        start_step = swarm.join(optimizer)
        if args.wait_peers:
            swarm.wait_for_peers(args.wait_peers)
            start_step = optimizer.step_count
        logger.info("training %s from step %d as %s%s", task.name, start_step, swarm.peer_id,
                    " (client mode)" * args.client_mode)
        train(args, task, batches_for, optimizer, swarm, stop, metrics, board)
    except Interrupted:
        pass  # a stop signal while waiting (joining, waiting for peers): leave now
    finally:
        stop.leaving()
        if stop.requested:
            print(f"left the run at step {optimizer.step_count} ({stop.received})", flush=True)
        if args.final_state:
            Path(args.final_state).write_bytes(snapshot.encode(optimizer)[0])
        if metrics:
            metrics.close()
        if board is not None:
            board.close()
        swarm.shutdown()
    return 0


def check_settings(args: argparse.Namespace) -> list[str]:
    """Everything that can be checked before starting a daemon; returns the initial peers to dial."""
    check_run_id(args.run_id)
    check_codecs(args.upload, args.result)
    for flag in ("--steps", "--checkpoint-every", "--momentum-every", "--eval-every", "--wait-peers", "--group-size"):
        if getattr(args, flag[2:].replace("-", "_")) < 0:
            raise UsageError(f"{flag} must be 0 or more, got {getattr(args, flag[2:].replace('-', '_'))}")
    if args.batch < 1:
        raise UsageError(f"--batch must be at least 1, got {args.batch}")
    if args.hidden is not None and args.hidden < 1:
        raise UsageError(f"--hidden must be at least 1, got {args.hidden}")
    if not (args.lr > 0 and args.weight_decay >= 0 and args.weight > 0):
        raise UsageError(f"--lr and --weight must be positive and --weight-decay 0 or more, got {args.lr}, "
                         f"{args.weight}, {args.weight_decay}")
    if not 0 < args.upload_timeout < args.result_timeout:
        raise UsageError(f"--upload-timeout {args.upload_timeout:g} must be positive and less than --result-timeout "
                         f"{args.result_timeout:g}")
    check_listen("--host-maddrs", args.host_maddrs)
    check_listen("--announce-maddrs", args.announce_maddrs)
    initial = check_peers("--initial-peers", list(args.initial_peers))
    if args.initial_peers_file:
        initial += check_peers(f"--initial-peers-file {args.initial_peers_file}:", read_peers_file(args.initial_peers_file))
    if args.checkpoint_dir:
        check_writable_dir("--checkpoint-dir", args.checkpoint_dir)
    if args.metrics_jsonl:
        check_writable_file("--metrics-jsonl", args.metrics_jsonl)
    return initial


def _tensorboard(logdir: str | None):
    if not logdir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UsageError("--tensorboard needs the tensorboard package: pip install 'lioncub-p2p[tensorboard]'") from None
    return SummaryWriter(logdir)


def train(args, task: TrainingTask, batches_for: Callable[[torch.Generator], Iterator], optimizer: LionCub,
          swarm: Swarm, stop: StopSignals, metrics, board=None) -> None:
    from tqdm import tqdm

    model = task.model
    gen = torch.Generator().manual_seed(int.from_bytes(swarm.peer_id.encode()[-6:], "big"))
    batches = batches_for(gen)
    swarm.samples_per_step = args.batch
    bar = None if args.quiet else tqdm(total=args.steps, initial=optimizer.step_count, unit="step", dynamic_ncols=True)
    started = time.monotonic()
    try:
        while optimizer.step_count < args.steps and not stop.requested \
                and not (args.max_seconds and time.monotonic() - started > args.max_seconds):
            with stop.deferred():  # a first stop signal lets this step finish
                t0 = time.perf_counter()
                batch = next(batches, None)
                if batch is None:
                    print(f"the task's data ran out at step {optimizer.step_count}", flush=True)
                    break
                loss = task.loss(model, batch)
                loss.backward()
                if args.step_delay:
                    time.sleep(args.step_delay)
                t1 = time.perf_counter()
                before = optimizer.step_count
                optimizer.step()
                optimizer.zero_grad()
                t2 = time.perf_counter()
                _report(args, task, swarm, optimizer, before, loss.item(), t0, t1, t2, metrics, board, bar)
    finally:
        if bar is not None:
            bar.close()
    if not stop.requested:
        finish(args, task, optimizer.step_count)


def _report(args, task: TrainingTask, swarm: Swarm, optimizer: LionCub, before: int, loss: float, t0: float,
            t1: float, t2: float, metrics, board, bar) -> None:
    """One step's metrics to the JSONL file, TensorBoard, and the progress bar or the log."""
    stats = swarm.stats
    swarm.last_loss = loss
    record = dict(step=before, loss=loss, peers=stats.peers, group=stats.group_size,
                  bytes_up=stats.bytes_up, bytes_down=stats.bytes_down, bits_per_param=stats.bits_per_param,
                  compute_s=t1 - t0, step_s=t2 - t1, wait_s=stats.wait_s, round_s=stats.round_s,
                  aggregate_s=stats.seconds, repaired=stats.repaired,
                  momentum_synced=stats.momentum_synced, time=time.time())
    if args.eval_every and optimizer.step_count % args.eval_every == 0:
        evaluate_into(record, task)
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
        bar.set_postfix(peers=f"{stats.peers}/{stats.group_size}", loss=f"{loss:.3f}",
                        up=f"{stats.bytes_up / seconds / 1e6:.2f}MB/s", down=f"{stats.bytes_down / seconds / 1e6:.2f}MB/s",
                        bits=f"{stats.bits_per_param:.2f}", time=f"{compute:.2f}c/{comm:.2f}m/{wait:.2f}w")
    elif optimizer.step_count % 50 == 0:
        logger.info("step %d loss %.3f peers %d/%d %.2f bits/param, s compute/comm/wait %.2f/%.2f/%.2f",
                    optimizer.step_count, loss, stats.peers, stats.group_size, stats.bits_per_param,
                    compute, comm, wait)


def evaluate_into(record: dict, task: TrainingTask) -> None:
    """Add the task's evaluation to a metrics record (``eval_loss``, ``eval_<name>``)."""
    for name, value in task.evaluation().items():
        record[f"eval_{name}"] = value


def finish(args, task: TrainingTask, step: int) -> None:
    results = task.evaluation()
    summary = ", ".join(f"test {name.replace('_', ' ')} {value:.3f}" for name, value in results.items())
    print(f"finished at step {step}" + (f": {summary}" if summary else ""), flush=True)
    if args.final_eval:
        Path(args.final_eval).write_text(json.dumps({"step": step, **{f"eval_{k}": v for k, v in results.items()}}))


if __name__ == "__main__":
    main()
