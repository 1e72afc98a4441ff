"""lioncub-train: a volunteer peer that trains the run's model with the swarm, no code to write.

    lioncub-train --run-id demo --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...
    lioncub-train --task byte-gpt ...                  # a built-in task: digits (default) or byte-gpt
    lioncub-train --task mytask:make_task ...          # your own: see lioncub_p2p/tasks/__init__.py

Listens on every interface (TCP) and prints which of its addresses others can dial.
What the run trains and how (task, lr, batch, encodings) comes from the run's manifest unless a flag
says otherwise: a flag that disagrees with the run stops the peer with one line. The manifest is any
peer's signed word: it can make this peer train a built-in task, within its declared arguments and
--max-params, never run code the peer's user did not name (--task, --trust-task). Before joining it
asks the coordinators to dial it back: behind NAT (nobody can dial it) it joins in client mode by
itself (it votes and receives every result, reduces nothing, serves no state); --client-mode on/off
forces either. Ctrl+C or SIGTERM leaves the run cleanly after the current step (a second one at once).
Settings are checked before joining: a mistake ends in one line saying what to change.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .. import LionCub, MomentumSchedule, failpoints
from ..swarm import Manifest, ManifestError, Swarm, SwarmConfig, SwarmError, snapshot
from ..swarm.manifest import DEFAULTS as SWARM_DEFAULTS
from ..identity import Verifier
from ..swarm.config import LISTEN_ALL, MAX_WEIGHT
from ..swarm.tickets import TicketError, decode
from ..tasks import BUILTIN, TaskError, TrainingTask, check_args, load_task, param_count
from ..trainer_rounds import allreduce_config
from .addresses import check_listen, check_peers, reachability
from .checks import (VOTE_RESULTS, VOTE_UPLOADS, check_checkpoint_fits, check_codecs, check_run_id,
                     check_writable_dir, check_writable_file)
from .common import HelpFormatter, UsageError, add_log_level, read_peers_file, setup_logging
from .evaluation import evaluate_into, finish
from .lifecycle import ChildReaper, Interrupted, StopSignals

logger = logging.getLogger("lioncub.train")
HIDDEN = argparse.SUPPRESS  # options for tests and the simulator, left out of --help
# the trainer's settings where neither a flag nor the run's manifest gives one
DEFAULTS = {"task": "digits", "batch": 32, "lr": 3e-4, "weight_decay": 0.1}
# the largest model this peer builds unless --max-params says otherwise: fp32 weights, gradients and Lion's
# momentum of 100M parameters take 1.2 GB, what a volunteer's machine can spare; the built-ins stay far below
DEFAULT_MAX_PARAMS = 100_000_000
CODE_TASK_ARGS = ("hidden",)  # what lioncub-train passes a module:function task from the run's task_args
CLIENT_MODES = {"auto": "auto", "on": True, "off": False}  # --client-mode -> SwarmConfig.client_mode
METHODS = {"lioncub": "butterfly", "dlion": "allgather", "hivemind-fp32": None, "hivemind-fp16": None}  # -> transport


@dataclass(frozen=True)
class Settings:
    """What this peer trains with: its flags, else the run's manifest, else DEFAULTS."""

    task: str
    hidden: int | None
    batch: int
    lr: float
    weight_decay: float

    @classmethod
    def of(cls, args: argparse.Namespace, run: Manifest | None = None) -> "Settings":
        """Raises UsageError/TaskError (one line) for a run this peer must not train as its manifest says:
        code its user did not name, task arguments out of range, a model over --max-params."""
        run = run or Manifest()
        task = args.task if args.task is not None else run_task(args, run)
        task_args = run_task_args(args, run, task)
        check_run_size(args, run)
        hidden = args.hidden if args.hidden is not None else task_args.get("hidden")
        pick = lambda flag, field, key: flag if flag is not None else field if field is not None else DEFAULTS[key]  # noqa: E731
        return cls(task=task, hidden=hidden, batch=pick(args.batch, run.batch_size, "batch"),
                   lr=pick(args.lr, run.lr, "lr"), weight_decay=pick(args.weight_decay, run.weight_decay, "weight_decay"))


def is_code_task(spec: str) -> bool:
    """``module:function`` with Python names (a suggestion to pass it on a command line is then safe to print)."""
    module, colon, function = spec.partition(":")
    return bool(colon) and function.isidentifier() and all(part.isidentifier() for part in module.split("."))


def run_task(args: argparse.Namespace, run: Manifest) -> str:
    """The task the run's manifest names (else the default) if this peer may train it: a built-in, or code
    its user trusts (--trust-task). A manifest is signed by its author, who is just another peer: the code
    it names is no more this user's choice than a file a stranger sent, so nothing of it is imported."""
    if run.task is None or run.task in BUILTIN or run.task in args.trust_task:
        return run.task or DEFAULTS["task"]
    if is_code_task(run.task):
        raise UsageError(f"run {args.run_id} trains task {run.task!r} (code the run's manifest names, not you): pass "
                         f"--task {run.task} (or --trust-task {run.task}) if you trust it and have its module")
    raise UsageError(f"run {args.run_id} trains task {run.task!r}, neither a built-in task ({', '.join(BUILTIN)}) "
                     f"nor module:function: ask the run's organizer which --task it trains")


def run_task_args(args: argparse.Namespace, run: Manifest, task: str) -> dict:
    """The run's task_args, checked for ``task``: a built-in's against the arguments it declares and their
    ranges; a module:function task's (the user's own code, which bounds itself) against what lioncub-train
    passes it."""
    values = dict(run.task_args or {})
    where = lambda key, value: f"run {args.run_id}'s task_args.{key}={value!r}"  # noqa: E731
    if task in BUILTIN:
        return check_args(task, values, where)
    for key, value in values.items():
        if key not in CODE_TASK_ARGS:
            raise UsageError(f"{where(key, value)}: lioncub-train passes a task function only "
                             f"{', '.join(CODE_TASK_ARGS)} of the run's task_args, so this peer cannot build its model")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{where(key, value)}: {key} must be a positive integer")
    return values


def check_run_size(args: argparse.Namespace, run: Manifest) -> None:
    """A run whose manifest says its model is larger than --max-params: one line before anything is built."""
    if run.param_count is not None and run.param_count > args.max_params:
        raise UsageError(f"run {args.run_id}'s model has {run.param_count:,} parameters (its manifest says), more "
                         f"than --max-params {args.max_params:,}: join another run, or raise --max-params if this "
                         f"machine can hold it")


def check_model_size(args: argparse.Namespace, count: int, what: str, fix: str) -> None:
    if count > args.max_params:
        raise UsageError(f"{what} {count:,} parameters, more than --max-params {args.max_params:,}: {fix}raise "
                         f"--max-params if this machine can hold it")


def opinions(args: argparse.Namespace) -> Manifest:
    """The trainer settings this peer's flags insist on (the rest it adopts from the run)."""
    try:
        return Manifest(task=args.task, task_args={"hidden": args.hidden} if args.hidden is not None else None,
                        lr=args.lr, weight_decay=args.weight_decay, batch_size=args.batch)
    except ManifestError as e:
        raise UsageError(f"{e}") from None


SECRET_ENV = "LIONCUB_RUN_SECRET"
TICKET_ENV = "LIONCUB_TICKET"
MIN_SECRET_CHARS = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lioncub-train", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    run = p.add_argument_group("the run")
    run.add_argument("--run-id", default="demo", help="name of the run to join (no dots)")
    run.add_argument("--initial-peers", nargs="*", default=[],
                     help="coordinators' multiaddrs, as they print them: /ip4/IP/tcp/PORT/p2p/PEER_ID")
    run.add_argument("--initial-peers-file", default=None, help="read --initial-peers from this file (waits for it)")
    run.add_argument("--run-secret", default=None,
                     help=f"the run's shared secret, if it has one (admission); else ${SECRET_ENV} if set, which "
                          "other users of this machine cannot read in its process list")
    run.add_argument("--allow-peers", nargs="*", default=[], help="admit only these peer ids")
    run.add_argument("--ticket", default=None,
                     help=f"an invited run: the ticket file its organizer gave you for your peer id (lioncub-invite); "
                          f"pass the same --identity-path whose id you sent them; else ${TICKET_ENV} (the ticket's text) "
                          f"if set")
    run.add_argument("--preflight", action="store_true",
                     help="check coordinators, reachability, bandwidth and round time, then exit")

    net = p.add_argument_group("network")
    net.add_argument("--host-maddrs", nargs="+", default=LISTEN_ALL,
                     help="where to listen (every interface, TCP, a port chosen by the OS)")
    net.add_argument("--announce-maddrs", nargs="*", default=[],
                     help="addresses others should dial, e.g. /ip4/PUBLIC_IP/tcp/PORT with a forwarded port")
    net.add_argument("--client-mode", nargs="?", const="on", default="auto", choices=CLIENT_MODES,
                     help="auto: client mode if the coordinators cannot dial this machine back (behind NAT); "
                          "on (the flag alone): dial out only, vote and get every result, reduce nothing; off: listen")
    net.add_argument("--weight", type=float, default=1.0, help="share of reduction work (e.g. your upload Mbit/s)")
    net.add_argument("--identity-path", default=None, help="private key file: keeps this peer's id across restarts")

    what = p.add_argument_group("what to train (unset: the run's manifest says, else the value in brackets)")
    what.add_argument("--task", default=None,
                      help=f"a built-in task ({', '.join(BUILTIN)}) or module:function returning "
                           f"(model, data, loss[, evaluate]); see the README's 'Bring your own model' "
                           f"[{DEFAULTS['task']}]")
    what.add_argument("--trust-task", action="extend", nargs="+", default=[], metavar="MODULE:FUNCTION",
                      help="if the run's manifest names this task, run it (your own code's task, installed here); "
                           "without it a manifest can make this peer train a built-in task only")
    what.add_argument("--hidden", type=int, default=None,
                      help="width of a built-in model: digits' hidden units [256, at most 4096], byte-gpt's "
                           "embedding [128, a multiple of 4 up to 1024]")
    what.add_argument("--max-params", type=int, default=DEFAULT_MAX_PARAMS,
                      help="refuse a run, or a task, whose model has more parameters than this (fp32 weights, "
                           "gradients and momentum: 12 bytes each)")
    what.add_argument("--batch", type=int, default=None, help=f"samples per step on each peer [{DEFAULTS['batch']}]")
    what.add_argument("--lr", type=float, default=None, help=f"Lion's learning rate [{DEFAULTS['lr']}]")
    what.add_argument("--weight-decay", type=float, default=None,
                      help=f"decoupled weight decay [{DEFAULTS['weight_decay']}]")
    what.add_argument("--seed", type=int, default=0, help="initializes the model (a joiner downloads the run's state)")
    what.add_argument("--steps", type=int, default=1000, help="stop at this global step")
    what.add_argument("--max-seconds", type=float, default=0.0, help="also stop after this many seconds (0: no limit)")
    what.add_argument("--linger", type=float, default=60.0,
                      help="after the last step, stay up to this many seconds for peers that are behind, so that "
                           "one dropped near the end can download the final state (a download under way is not "
                           "cut: it may take minutes on a slow link) [60]")
    what.add_argument("--wait-peers", type=int, default=0,
                      help="start training once this many peers are in the group (0: at once)")

    proto = p.add_argument_group("protocol (every peer of a run uses the same; unset: the run's, else [value])")
    proto.add_argument("--method", default=None, choices=list(METHODS),
                       help="lioncub: butterfly vote; dlion: all-gather of votes; hivemind-*: full-precision "
                            "gradient averaging with hivemind's DecentralizedAverager (baselines) [lioncub]")
    proto.add_argument("--upload", default=None, help=f"vote encoding: {VOTE_UPLOADS} [sign]")
    proto.add_argument("--result", default=None, help=f"result encoding: {' | '.join(VOTE_RESULTS)} [majority]")
    proto.add_argument("--momentum-every", type=int, default=None,
                       help="average all momenta every K steps in one round (0: never), instead of streaming "
                            "[off: streamed]")
    proto.add_argument("--momentum-slices", type=int, default=None,
                       help="streamed momentum averaging: every step averages 1/K of it, so no step waits for a "
                            "whole-buffer round (replaces --momentum-every) [20]")
    proto.add_argument("--momentum-wire", default=None,
                       help="momentum values on the wire, fp8 (e4m3 sharing an exponent per 7 values, 9.1 bits) or "
                            "bf16 (16 bits) [fp8]")
    proto.add_argument("--delay", type=int, default=None, choices=(0, 1),
                       help="1: overlapped rounds, each vote travels during the next step's compute and is "
                            "applied one step late [0]")
    proto.add_argument("--max-group", type=int, default=None,
                       help="a two-level vote for large runs: groups of at most this many peers (never one "
                            "alone) vote inside themselves and their counts are combined into the same majority "
                            "(fewer streams per peer; 0: one flat group) [0]")
    proto.add_argument("--upload-timeout", type=float, default=10.0, help="seconds a reducer waits for votes")
    proto.add_argument("--result-timeout", type=float, default=20.0,
                       help="seconds a voter waits for results (more than --upload-timeout)")
    proto.add_argument("--no-result-deltas", dest="result_deltas", action="store_false",
                       help="always take and send plain majority results, never flips against an earlier "
                            "result (costs 12-56%% more result bytes; for measuring what deltas save)")
    proto.add_argument("--group-size", type=int, default=0, help="hivemind baselines: peers per averaging group (0: 2)")

    out = p.add_argument_group("output")
    out.add_argument("--checkpoint-dir", default=None, help="resume from and save checkpoints in this folder")
    out.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    out.add_argument("--metrics-jsonl", default=None, help="append one JSON line per step (lioncub-plot reads it)")
    out.add_argument("--tensorboard", default=None, help="also log metrics to this TensorBoard directory")
    out.add_argument("--eval-every", type=int, default=0, help="evaluate every this many steps (0: at the end only)")
    out.add_argument("--quiet", action="store_true", help="no progress bar; a log line every 50 steps")
    add_log_level(out)

    p.add_argument("--final-state", default=None, help=HIDDEN)  # the final snapshot (tests compare them)
    p.add_argument("--final-eval", default=None, help=HIDDEN)  # the final evaluation as JSON (the simulator)
    p.add_argument("--step-delay", type=float, default=0.0, help=HIDDEN)  # extra seconds per step (slow compute)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level)
    torch.set_num_threads(1)  # volunteers share machines; the built-in tasks are small
    with StopSignals() as stop, ChildReaper() as reaper:
        try:
            code = run(args, stop)
        except Interrupted:
            code = 0  # stopped before joining: nothing to leave
            print(f"stopped before joining the run ({stop.received})", flush=True)
        except (UsageError, TaskError, SwarmError, ManifestError, snapshot.SnapshotError) as e:
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
    wanted = opinions(args)
    # a task named on the command line is checked before any daemon starts; otherwise the run's
    # manifest (read once the DHT is up) says which task to build
    own = Settings.of(args)
    early = prepare_task(args, own) if args.task is not None or args.hidden is not None else None
    if args.method and args.method.startswith("hivemind"):
        from .baseline import train_with_hivemind_averager

        task, batches_for = early or prepare_task(args, own)
        plain = argparse.Namespace(**{**vars(args), "client_mode": CLIENT_MODES[args.client_mode] is True})
        train_with_hivemind_averager(plain, own, task, batches_for, initial_peers, stop)
        return 0
    config = SwarmConfig(args.run_id, initial_peers=initial_peers,
                         host_maddrs=args.host_maddrs, announce_maddrs=args.announce_maddrs,
                         identity_path=args.identity_path, client_mode=CLIENT_MODES[args.client_mode], weight=args.weight,
                         run_secret=args.run_secret, allow_peers=args.allow_peers, ticket=args.ticket_text,
                         upload=args.upload, result=args.result, transport=METHODS.get(args.method),
                         momentum=momentum_schedule(args),
                         delay=args.delay, max_group=args.max_group, manifest=wanted, allreduce=allreduce_config(args.upload_timeout, args.result_timeout, args.result_deltas),
                         checkpoint_dir=args.checkpoint_dir,
                         checkpoint_every=args.checkpoint_every if args.checkpoint_dir else 0)

    def task_for(run: Manifest) -> tuple[Settings, TrainingTask, Callable[[torch.Generator], Iterator]]:
        settings = Settings.of(args, run)
        if early is not None and (settings.task, settings.hidden, settings.batch) == (own.task, own.hidden, own.batch):
            return settings, *early
        return settings, *prepare_task(args, settings)

    if args.preflight:
        from .preflight import preflight

        return preflight(config, task_for)
    swarm = Swarm(config)
    optimizer = None
    metrics = board = None
    try:
        if not (swarm.config.client_mode and swarm.listen_plan.note):  # else the swarm said why, in one line
            for line in reachability(swarm.visible_maddrs(), client_mode=swarm.config.client_mode):
                print(line, flush=True)
        settings, task, batches_for = task_for(swarm.manifest)
        params = list(task.model.named_parameters())
        if args.checkpoint_dir:  # a checkpoint of another model: one line now, not a SnapshotError after joining
            check_checkpoint_fits(args.checkpoint_dir, LionCub(params, lr=settings.lr),
                                  hint="--task and --hidden", run_id=args.run_id)
        optimizer = LionCub(params, lr=settings.lr, weight_decay=settings.weight_decay, aggregator=swarm)
        metrics = open(args.metrics_jsonl, "a") if args.metrics_jsonl else None
        board = _tensorboard(args.tensorboard)
        swarm.final_step = args.steps
        start_step = swarm.join(optimizer, wait_peers=args.wait_peers)
        logger.info("training %s from step %d as %s%s", task.name, start_step, swarm.peer_id,
                    " (client mode)" * swarm.config.client_mode)
        train(args, settings, task, batches_for, optimizer, swarm, stop, metrics, board)
    except Interrupted:
        pass  # a stop signal while waiting (joining, waiting for peers): leave now
    finally:
        stop.leaving()
        step = optimizer.step_count if optimizer is not None else 0
        if stop.requested:
            print(f"left the run at step {step} ({stop.received})", flush=True)
        if args.final_state and optimizer is not None:
            Path(args.final_state).write_bytes(snapshot.encode(optimizer)[0])
        if metrics:
            metrics.close()
        if board is not None:
            board.close()
        swarm.shutdown()
    return 0


def prepare_task(args: argparse.Namespace, settings: Settings) -> tuple[TrainingTask, Callable[[torch.Generator], Iterator]]:
    """Build the task and check it on one batch; one line (UsageError/TaskError) if it is broken or its model
    has more than --max-params parameters (a built-in's counted before anything is allocated)."""
    if settings.task in BUILTIN:
        options = {"hidden": settings.hidden} if settings.hidden is not None else {}
        check_model_size(args, param_count(settings.task, **options), f"task {settings.task}"
                         + "".join(f" with {k} {v}" for k, v in options.items()) + " has", "lower --hidden, or ")
    task = load_task(settings.task, seed=args.seed, batch=settings.batch, hidden=settings.hidden)
    check_model_size(args, sum(p.numel() for p in task.model.parameters()), f"--task {settings.task} built a model of",
                     "")
    try:
        return task, task.checked_batches(settings.batch)
    except TaskError as e:
        raise UsageError(f"--task {settings.task}: {e}") from None


def momentum_schedule(args: argparse.Namespace) -> MomentumSchedule | None:
    """The schedule the flags ask for; None: the run's."""
    default = SWARM_DEFAULTS.momentum_schedule()
    wire = args.momentum_wire or default.wire
    if wire not in ("bf16", "fp8"):
        raise UsageError(f"--momentum-wire {wire}: use bf16 (16 bits per value) or fp8 (e4m3 in blocks of 7 values, "
                         f"9.1 bits)")
    if args.momentum_slices:
        if args.momentum_every:
            raise UsageError("--momentum-slices replaces --momentum-every: give one of them")
        return MomentumSchedule(slices=args.momentum_slices, wire=wire)
    if args.momentum_every is not None:
        return MomentumSchedule(every=args.momentum_every, wire=wire)
    if args.momentum_wire is not None:  # the default schedule, in the wire format asked for
        return replace(default, wire=wire)
    return None


def check_settings(args: argparse.Namespace) -> list[str]:
    """Everything that can be checked before starting a daemon; returns the initial peers to dial."""
    check_run_id(args.run_id)
    check_codecs(args.upload or "sign", args.result or "majority")
    for flag in ("--steps", "--checkpoint-every", "--momentum-every", "--momentum-slices", "--eval-every", "--wait-peers",
                 "--group-size", "--linger", "--max-seconds"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not value >= 0:  # (nan is not)
            raise UsageError(f"{flag} must be 0 or more, got {value}")
    momentum_schedule(args)  # one line for conflicting momentum flags, before any daemon starts
    for flag in ("--batch", "--hidden", "--max-params"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    for spec in args.trust_task:
        if not is_code_task(spec):
            raise UsageError(f"--trust-task {spec}: name a task as module:function (e.g. --trust-task mytask:make_task)"
                             + ("; a built-in task needs no trust" if spec in BUILTIN else ""))
    for flag, value, low in (("--lr", args.lr, 0.0), ("--weight", args.weight, 0.0)):
        if value is not None and not value > low:
            raise UsageError(f"{flag} must be positive, got {value:g}")
    if args.weight is not None and args.weight > MAX_WEIGHT:
        raise UsageError(f"--weight must be at most {MAX_WEIGHT:g} (your upload Mbit/s, say), got {args.weight:g}")
    secret_flag = "--run-secret"
    if args.run_secret is None and os.environ.get(SECRET_ENV) is not None:
        args.run_secret, secret_flag = os.environ[SECRET_ENV], f"${SECRET_ENV}"
    if args.method and args.method.startswith("hivemind"):  # the baseline trains without these: say so
        ignored = [flag for flag, value in ((secret_flag, args.run_secret), ("--allow-peers", args.allow_peers),
                                            ("--checkpoint-dir", args.checkpoint_dir),
                                            ("--identity-path", args.identity_path), ("--ticket", args.ticket),
                                            ("--tensorboard", args.tensorboard)) if value]
        if ignored:
            raise UsageError(f"--method {args.method} (hivemind's averager, a baseline) has no {', '.join(ignored)}: "
                             f"leave {'it' if len(ignored) == 1 else 'them'} out, or use --method lioncub")
    args.ticket_text = check_ticket(args)
    if args.run_secret is not None and not args.run_secret:
        raise UsageError(f"--run-secret (or ${SECRET_ENV}) is empty (is the variable you passed set?): pass the "
                         "run's secret, or leave it out for an open run")
    if args.run_secret is not None and len(args.run_secret) < MIN_SECRET_CHARS:
        # anyone posing as the run's leader receives a newcomer's proof and may test guesses on it offline
        print(f"warning: a run secret of {len(args.run_secret)} characters can be guessed offline from one admission "
              f"exchange: use {MIN_SECRET_CHARS} or more random ones (openssl rand -hex 16)", file=sys.stderr)
    if args.weight_decay is not None and not args.weight_decay >= 0:
        raise UsageError(f"--weight-decay must be 0 or more, got {args.weight_decay:g}")
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
    if args.tensorboard:
        check_writable_dir("--tensorboard", args.tensorboard)
    return initial


def check_ticket(args: argparse.Namespace) -> str | None:
    """The ticket's text (--ticket FILE, else $LIONCUB_TICKET), checked against this run and identity file
    before anything starts; None without one."""
    if args.ticket is not None:
        try:
            text = Path(args.ticket).read_text().strip()
        except OSError as e:
            raise UsageError(f"--ticket {args.ticket}: cannot read it ({e.strerror or e}): pass the file lioncub-invite "
                             f"issue wrote") from None
        except UnicodeDecodeError:
            raise UsageError(f"--ticket {args.ticket} is not a ticket (a ticket is one line of text): pass the file "
                             f"lioncub-invite issue wrote") from None
        flag = f"--ticket {args.ticket}"
    elif os.environ.get(TICKET_ENV):
        text, flag = os.environ[TICKET_ENV].strip(), f"${TICKET_ENV}"
    else:
        return None
    try:
        ticket = decode(text, Verifier())
    except TicketError as e:
        raise UsageError(f"{flag}: {e}") from None
    if ticket.run_id != args.run_id:
        raise UsageError(f"{flag} is for run {ticket.run_id}, not --run-id {args.run_id}: pass --run-id {ticket.run_id}, "
                         f"or ask the organizer of {args.run_id} for a ticket")
    if not args.identity_path:
        raise UsageError(f"{flag} admits one peer id ({ticket.peer_id}): pass --identity-path with the key file whose "
                         f"id you sent the organizer (lioncub-invite id --identity-path FILE prints it)")
    if ticket.expires <= time.time():
        raise UsageError(f"{flag}: {ticket.describe()}: ask the run's organizer for a new one")
    return text


def _tensorboard(logdir: str | None):
    if not logdir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UsageError("--tensorboard needs the tensorboard package: pip install 'lioncub-p2p[tensorboard]'") from None
    return SummaryWriter(logdir)


def train(args, settings: Settings, task: TrainingTask, batches_for: Callable[[torch.Generator], Iterator],
          optimizer: LionCub, swarm: Swarm, stop: StopSignals, metrics, board=None) -> None:
    from tqdm import tqdm

    model = task.model
    gen = torch.Generator().manual_seed(int.from_bytes(swarm.peer_id.encode()[-6:], "big"))
    batches = batches_for(gen)
    swarm.samples_per_step = settings.batch
    bar = None if args.quiet else tqdm(total=args.steps, initial=optimizer.step_count, unit="step", dynamic_ncols=True)
    started = time.monotonic()
    try:
        while optimizer.step_count < args.steps and not stop.requested and swarm.stranded is None \
                and not (args.max_seconds and time.monotonic() - started > args.max_seconds):
            failpoints.before_step(optimizer.step_count)  # a fault test's hung data loader (unset: nothing)
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
    if swarm.stranded is not None:  # one line, exit 1; the final state is still written
        raise SwarmError(f"stopped at step {optimizer.step_count}: {swarm.stranded}")
    if not stop.requested:
        ended = optimizer.step_count >= args.steps  # the run's end (not --max-seconds)
        started_settling = time.monotonic()
        if ended:  # before the final state is written: a split in the last round has no round to repair it
            swarm.settle_final_state(args.linger)
        finish(args.final_eval, task, optimizer.step_count)
        if ended:  # others may still need this state
            swarm.linger(max(args.linger - (time.monotonic() - started_settling), 0.0))


def _report(args, task: TrainingTask, swarm: Swarm, optimizer: LionCub, before: int, loss: float, t0: float,
            t1: float, t2: float, metrics, board, bar) -> None:
    """One step's metrics to the JSONL file, TensorBoard, and the progress bar or the log."""
    stats = swarm.stats
    swarm.last_loss = loss
    record = dict(step=before, loss=loss, peers=stats.peers, group=stats.group_size,
                  bytes_up=stats.bytes_up, bytes_down=stats.bytes_down, bits_per_param=stats.bits_per_param,
                  result_down=stats.result_down, result_plain=stats.result_plain,
                  compute_s=t1 - t0, step_s=t2 - t1, wait_s=stats.wait_s, round_s=stats.round_s,
                  aggregate_s=stats.seconds, repaired=stats.repaired, followed=stats.followed,
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


if __name__ == "__main__":
    main()
