"""lioncub-compare: vote encodings against global Lion, in process (no network), over seeds.

n simulated workers each hold a replica of the model, draw their own batches and keep their own
momentum. Every step each worker packs its direction with the real upload codec, one reducer
tallies all uploads with the real codecs, and every worker applies the decoded result; momenta are
averaged on a ``MomentumSchedule``, exactly or as the swarm does it (bf16 or fp8 blocks on the
wire, trimmed mean). Global Lion is data-parallel Lion: gradients averaged over the workers' batches (the same
samples) and one shared momentum.

Quality is read the way ``lioncub_p2p.sim.quality`` explains: the workers' mean training loss per
step, smoothed over a window, at several steps, mean ± spread over seeds, and the headline "steps
to reach the baseline's smoothed loss at step K" (paired by seed). ``--lr-sweep`` picks each
method's own best lr on a separate seed first.

Bits per element per step count what one peer sends plus receives, before the butterfly's
(n−1)/n factor: global Lion 32 up + 32 down (fp32); a vote = upload bits + result bits; a momentum
sync adds 16 + 16 (bf16 all-reduce; 64/7 + 64/7 in fp8 blocks) per synced element on the steps it runs.

    lioncub-compare --task byte-gpt --hidden 64 --steps 300 --seeds 3 --lr-sweep 5e-4,1e-3,2e-3
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..codecs import reduce_votes, result_codec, upload_codec, wire_bits_per_element
from ..momentum import MomentumSchedule
from ..optim import LionCub
from ..tasks import BUILTIN, TaskError
from . import quality
from .report_files import check_report_path, keep_previous_report
from .compare_tasks import CompareTask, DataExhausted, SpecTask, as_compare_task
from .variants import check_variant, run_variant
from .workers import (FP32_BITS, Clock, Method, MomentumSyncs, Outcome, corrupt, momentum_wire_bits,
                      worker_loss)

# ---------------------------------------------------------------------------------------------
# Methods


def parse_method(spec: str) -> Method:
    """``global``, or ``UPLOAD/RESULT[+OPTION...]``: e.g. ``sign/majority+sync25+bf16``, ``l1:4/ternary``.

    Options: ``syncK`` momentum average every K steps, ``geoR`` at steps 1, R, R², ... , ``streamK``
    1/K of it every step (``MomentumSchedule(slices=K)``), ``untilT`` none after step T, ``bf16`` the swarm's bf16 trimmed mean instead of an exact one (``bf16mean``: its
    plain mean; ``fp8``, ``fp8mean``: the same in fp8 blocks), ``lrX`` this method's own lr; any other option names a variant of ``sim/variants.py``."""
    spec = spec.strip()
    if spec == "global":
        return Method("global")
    head, *options = spec.split("+")
    upload, slash, result = head.partition("/")
    if not slash:
        raise ValueError(f"method {spec!r}: expected 'global' or UPLOAD/RESULT[+OPTION...], e.g. sign/majority+sync25")
    upload_codec(upload)  # ValueError naming the encoding if unknown
    result_codec(result)
    if result in ("average", "trimmed_mean"):
        raise ValueError(f"method {spec!r}: {result} is the momentum rule, not a vote result; use majority, "
                         f"ternary or mean")
    every, geometric, until, slices, rule, lr, variant, wire = 0, None, None, 0, "exact", None, [], "bf16"
    for option in options:
        try:
            if option.startswith("sync"):
                every = int(option[4:])
            elif option.startswith("geo"):
                geometric = float(option[3:])
            elif option.startswith("until"):
                until = int(option[5:])
            elif option.startswith("stream"):
                slices = int(option[6:])
            elif option in ("bf16", "bf16mean", "fp8", "fp8mean"):
                rule = "average" if option.endswith("mean") else "trimmed_mean"
                wire = "bf16" if option.startswith("bf16") else "fp8"
            elif option.startswith("lr") and option[2:3].isdigit():
                lr = float(option[2:])
            else:
                variant.append(option)
        except ValueError:
            raise ValueError(f"method {spec!r}: option {option!r} needs a number, e.g. sync25, geo1.5, stream25, until100, "
                             f"lr1e-3") from None
    try:
        schedule = MomentumSchedule(every=every, geometric=geometric, until=until, slices=slices, wire=wire)
    except ValueError as e:
        raise ValueError(f"method {spec!r}: {e}") from None
    if variant:
        for name in variant:
            check_variant(name, spec)
    return Method(spec, upload, result, schedule, rule, tuple(variant), lr)


DEFAULT_METHODS = ("global", "sign/majority", "sign/majority+sync10", "sign/ternary", "sign/mean", "l1:4/majority")


# ---------------------------------------------------------------------------------------------
# One run


def run_method(method: Method, task: Any, *, workers: int = 4, steps: int = 300, batch: int = 32,
               lr: float = 3e-4, weight_decay: float = 0.1, seed: int = 0,
               byzantine: dict[int, str] | None = None, eval_at: Sequence[int] = ()) -> Outcome:
    """Train with ``workers`` simulated peers; ``byzantine[i]`` makes worker i send corrupt votes
    ("random" bits, "invert"ed votes, all "ones") while training honestly on its data. ``eval_at``:
    steps after which to evaluate (the end always is). ``method.lr`` overrides ``lr``."""
    task = as_compare_task(task)
    lr = method.lr or lr
    if method.variant:
        return run_variant(method, task, workers=workers, steps=steps, batch=batch, lr=lr, weight_decay=weight_decay,
                           seed=seed, eval_at=eval_at)
    start = time.perf_counter()
    gens = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(workers)]
    base = task.make_model(seed)
    sources = task.batches(workers, batch, gens)
    curve: list[tuple[int, float]] = []
    evals: list[tuple[int, dict]] = []
    clock = Clock()
    wanted = {k for k in eval_at if 0 < k < steps}
    if method.upload is None:
        opt = LionCub(base.named_parameters(), lr=lr, weight_decay=weight_decay)
        for step in range(steps):
            opt.zero_grad()
            try:  # mean of the workers' losses: the mean of their gradients, as an all-reduce gives
                losses = [worker_loss(task, base, src, clock, 1.0 / workers) for src in sources]
            except DataExhausted:
                break
            opt.step()
            curve.append((step, sum(losses) / len(losses)))
            if step + 1 in wanted:
                evals.append((step + 1, task.evaluate(base)))
        return _outcome(method, task, base, curve, evals, workers, 2 * FP32_BITS, FP32_BITS, True, start, lr, seed,
                        clock)

    up, res = upload_codec(method.upload), result_codec(method.result)
    replicas = [copy.deepcopy(base) for _ in range(workers)]
    opts = [LionCub(m.named_parameters(), lr=lr, weight_decay=weight_decay, upload=up, seed=seed) for m in replicas]
    nbytes, syncs = opts[0].buffer_bytes, MomentumSyncs(method.momentum, method.momentum_rule)
    numel = sum(p.numel() for p in base.parameters())
    for step in range(steps):
        uploads, losses = [], []
        try:
            for model, opt, src in zip(replicas, opts, sources):
                opt.zero_grad()
                losses.append(worker_loss(task, model, src, clock))
                uploads.append(opt.compute_upload())
        except DataExhausted:
            break
        curve.append((step, sum(losses) / len(losses)))
        for i, behavior in (byzantine or {}).items():
            uploads[i] = corrupt(uploads[i], up, behavior, gens[i])
        wire = reduce_votes(uploads, up, res, numel=nbytes * 8, seed=seed, step=step)
        update = res.decode(wire, nbytes * 8, workers * up.max_code)
        for opt in opts:
            opt.apply_aggregate(update)
        syncs.after_step([opt.momentum_buffers() for opt in opts], step + 1)
        if step + 1 in wanted:
            evals.append((step + 1, task.evaluate(replicas[0])))
    identical = all(torch.equal(a, b) for m in replicas[1:] for a, b in zip(replicas[0].parameters(), m.parameters()))
    done = max(len(curve), 1)
    sync_bits = momentum_wire_bits(method.momentum) * syncs.synced / numel / done  # per direction
    return _outcome(method, task, replicas[0], curve, evals, workers,
                    wire_bits_per_element(up, res, workers) + 2 * sync_bits, up.bits_per_element + sync_bits,
                    identical, start, lr, seed, clock)


def _outcome(method: Method, task: CompareTask, model: nn.Module, curve: list, evals: list, workers: int, bits: float,
             upload_bits: float, identical: bool, start: float, lr: float, seed: int, clock: Clock) -> Outcome:
    final = task.evaluate(model)
    evals.append((len(curve), final))
    values = list(final.values())
    loss = final.get("loss", values[0] if values else float("nan"))
    second = next((v for k, v in final.items() if k != "loss"), float("nan"))
    return Outcome(method.name, len(curve), workers, second, loss, bits, identical, time.perf_counter() - start, curve,
                   task.train_loss(model), upload_bits, lr, seed, evals, clock.median())


# ---------------------------------------------------------------------------------------------
# Many runs: seeds, lr sweeps, a cache of finished runs


@dataclass(frozen=True)
class Setup:
    """Everything a run's result depends on besides method, lr and seed."""

    task: str
    hidden: int | None
    workers: int
    steps: int
    batch: int
    weight_decay: float
    eval_at: tuple[int, ...]


class RunCache:
    """Finished runs as JSON lines, keyed by setup, method, lr and seed: a long comparison that is
    stopped resumes where it was (``--cache``)."""

    def __init__(self, path: Path | None):
        self.path, self.runs = path, {}
        if path is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    self.runs[row["key"]] = row["outcome"]
                except (ValueError, KeyError):
                    continue  # a line cut short by an interrupted write

    @staticmethod
    def key(setup: Setup, method: Method, lr: float, seed: int) -> str:
        return json.dumps([asdict(setup), method.name, lr, seed])

    def get(self, key: str) -> Outcome | None:
        row = self.runs.get(key)
        if row is None:
            return None
        row = dict(row)
        row["curve"] = [tuple(c) for c in row["curve"]]
        row["evals"] = [tuple(e) for e in row["evals"]]
        return Outcome(**row)

    def put(self, key: str, outcome: Outcome) -> None:
        self.runs[key] = asdict(outcome)
        if self.path is not None:  # one write on an O_APPEND file: comparisons sharing a cache never interleave
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, (json.dumps({"key": key, "outcome": asdict(outcome)}) + "\n").encode())
            finally:
                os.close(fd)


@dataclass
class MethodRuns:
    method: Method
    lr: float
    sweep: dict = field(default_factory=dict)  # lr -> smoothed final training loss on the sweep seed
    outcomes: list = field(default_factory=list)  # one per seed


def run_all(methods: Sequence[Method], task: CompareTask, setup: Setup, *, seeds: Sequence[int], lr: float,
            lr_sweep: Sequence[float] = (), sweep_seed: int = 1000, sweep_step: int | None = None, window: int = 20,
            cache: RunCache | None = None,
            log: Callable[[str], None] = print) -> list[MethodRuns]:
    """Every method on every seed, each at its own lr: ``method.lr``, else the best of ``lr_sweep``
    (the lowest smoothed training loss at ``sweep_step``, else the last step, on ``sweep_seed``, a seed not
    reported),
    else ``lr``."""
    cache = cache or RunCache(None)

    def one(method: Method, at: float, seed: int) -> Outcome:
        key = RunCache.key(setup, method, at, seed)
        found = cache.get(key)
        if found is None:
            found = run_method(replace(method, lr=at), task, workers=setup.workers, steps=setup.steps, batch=setup.batch,
                               lr=at, weight_decay=setup.weight_decay, seed=seed, eval_at=setup.eval_at)
            cache.put(key, found)
            log(f"  {method.name} lr {at:g} seed {seed}: smoothed train loss "
                f"{quality.smoothed_at(found.losses, found.steps, window):.4f} ({found.seconds:.0f} s)")
        return found

    runs = []
    for method in methods:
        chosen, sweep = method.lr or lr, {}
        if lr_sweep and method.lr is None:
            def score(candidate: float, method: Method = method) -> float:
                o = one(method, candidate, sweep_seed)
                return quality.smoothed_at(o.losses, min(sweep_step or o.steps, o.steps), window)

            chosen, sweep = search_lr(sorted(set(lr_sweep)), lr, score)
            edge = " (at the edge of the grid: widen it)" if chosen in (min(lr_sweep), max(lr_sweep)) else ""
            log(f"{method.name}: lr {chosen:g}{edge}")
        runs.append(MethodRuns(method, chosen, sweep, [one(method, chosen, seed) for seed in seeds]))
    return runs


def search_lr(grid: Sequence[float], start: float, score: Callable[[float], float]) -> tuple[float, dict]:
    """A local search on a sorted grid of lrs: from the point nearest ``start`` (in log scale), move to
    the better neighbour until neither is better. Returns the lr and every score it took (a NaN, a run
    that diverged, counts as worst). Loss against lr is about convex on a log grid, so this finds
    the grid's best with ~3 runs instead of one per point."""
    scores: dict[int, float] = {}

    def at(k: int) -> float:
        if k not in scores:
            value = score(grid[k])
            scores[k] = value if math.isfinite(value) else math.inf
        return scores[k]

    i = min(range(len(grid)), key=lambda k: abs(math.log(grid[k] / start)))
    at(i)
    while True:
        neighbours = [k for k in (i - 1, i + 1) if 0 <= k < len(grid)]
        best = min(neighbours, key=at, default=None)
        if best is None or at(best) >= at(i):
            return grid[i], {grid[k]: v for k, v in sorted(scores.items())}
        i = best


# ---------------------------------------------------------------------------------------------
# Summaries


def default_eval_points(steps: int) -> tuple[int, ...]:
    return tuple(sorted({max(1, steps // 4), max(1, steps // 2), max(1, 3 * steps // 4), steps}))


@dataclass
class Summary:
    method: str
    lr: float
    bits: float
    upload_bits: float
    train_at: dict  # step -> smoothed training loss per seed
    gap_at_target: list  # per seed: relative gap to the baseline's smoothed loss at the target step
    steps_ratio: list  # per seed: steps to reach the baseline's loss at the target step / target (None: never)
    test_loss: list  # per seed, at the end
    sweep: dict


def summarize(runs: Sequence[MethodRuns], *, window: int, target: int, points: Sequence[int],
              baseline: int = 0) -> list[Summary]:
    """Per method: smoothed training losses at ``points``, and against ``runs[baseline]`` paired by
    seed, the gap at step ``target`` and the steps it takes to reach the baseline's loss there."""
    base = {o.seed: o for o in runs[baseline].outcomes}
    rows = []
    for r in runs:
        gaps, ratios = [], []
        for o in r.outcomes:
            b = base.get(o.seed)
            if b is None:
                continue
            goal = quality.smoothed_at(b.losses, target, window)
            gaps.append(quality.relative_gap(quality.smoothed_at(o.losses, target, window), goal))
            reached = quality.steps_to_reach(o.losses, goal, window)
            ratios.append(reached / target if reached is not None else None)
        rows.append(Summary(
            r.method.name, r.lr, statistics_mean([o.bits_per_element_per_step for o in r.outcomes]),
            statistics_mean([o.upload_bits for o in r.outcomes]),
            {k: [quality.smoothed_at(o.losses, k, window) for o in r.outcomes] for k in points},
            gaps, ratios, [o.test_loss for o in r.outcomes], r.sweep))
    return rows


def statistics_mean(values: Sequence[float]) -> float:
    return quality.mean_spread(values)[0]


def format_summary(rows: Sequence[Summary], *, window: int, target: int, points: Sequence[int], steps: int,
                   baseline: str) -> str:
    head = (["method", "lr", "bits/param/step (up+down)"] + [f"train @{k}" for k in points]
            + [f"gap vs {baseline} @{target}", f"steps to {baseline}'s loss @{target}", "test loss (end)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in rows:
        cells = [s.method, f"{s.lr:g}", f"{s.bits:.2f}"] + [quality.fmt(s.train_at[k]) for k in points]
        cells += [quality.fmt(s.gap_at_target, 1, percent=True), quality.fmt_ratio(s.steps_ratio, steps / target),
                  quality.fmt(s.test_loss)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lioncub-compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--task", default="digits", help=f"{' | '.join(BUILTIN)} | module:function (lioncub_p2p.tasks)")
    p.add_argument("--hidden", type=int, default=None, help="the task's width (its own default if unset)")
    p.add_argument("--workers", type=int, default=4, help="simulated peers")
    p.add_argument("--steps", type=int, default=300, help="steps per run")
    p.add_argument("--batch", type=int, default=32, help="samples per worker per step")
    p.add_argument("--lr", type=float, default=3e-4, help="every method's lr, unless swept or given per method")
    p.add_argument("--lr-sweep", default="",
                   help="comma-separated grid of lrs: each method runs at its best one, found by a local search "
                        "from the grid point nearest --lr")
    p.add_argument("--sweep-seed", type=int, default=1000, help="the seed the lr sweep runs on (not reported)")
    p.add_argument("--sweep-step", type=int, default=None,
                   help="the step whose smoothed loss ranks the lrs [--steps]; earlier for tasks whose training "
                        "loss reaches ~0 (digits), where the last step ranks noise floors"),
    p.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1, paired across methods")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   help="global | UPLOAD/RESULT[+syncK|+geoR|+streamK|+untilT|+bf16|+lrX|+VARIANT]; the first is the baseline")
    p.add_argument("--window", type=int, default=20, help="steps in the smoothed training loss")
    p.add_argument("--eval-at", default="", help="comma-separated steps to report (default: quarters of --steps)")
    p.add_argument("--target-step", type=int, default=None,
                   help="K of 'steps to reach the baseline's loss at step K' [2/3 of --steps]")
    p.add_argument("--cache", type=Path, default=None, help="JSON lines of finished runs, reused when rerun")
    p.add_argument("--out", type=Path, default=Path("runs/compare.json"), help="the report (JSON)")
    return p.parse_args(argv)


def _numbers(text: str, kind: type, flag: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: {flag} {text!r}: expected comma-separated numbers, e.g. {flag} 3e-4,1e-3") from None


def main(argv: list[str] | None = None) -> None:
    run(argv)


def run(argv: list[str] | None = None) -> list[Summary]:
    """lioncub-compare: the summary rows it printed (the report is in ``--out``)."""
    args = parse_args(argv)
    sweep = _numbers(args.lr_sweep, float, "--lr-sweep")
    points = tuple(_numbers(args.eval_at, int, "--eval-at")) or default_eval_points(args.steps)
    target = args.target_step or max(1, 2 * args.steps // 3)
    problems = [(args.steps < 1, "--steps must be >= 1"), (args.workers < 1, "--workers must be >= 1"),
                (args.seeds < 1, "--seeds must be >= 1"), (args.window < 1, "--window must be >= 1"),
                (not 1 <= target <= args.steps, f"--target-step {target} must lie in 1..--steps ({args.steps})"),
                (any(not 1 <= k <= args.steps for k in points), f"--eval-at steps must lie in 1..{args.steps}"),
                (args.sweep_step is not None and not 1 <= args.sweep_step <= args.steps,
                 f"--sweep-step must lie in 1..{args.steps}"),
                (any(x <= 0 for x in sweep + [args.lr]), "learning rates must be positive")]
    for bad, message in problems:
        if bad:
            raise SystemExit(f"error: {message}")
    check_report_path("--out", args.out)  # now, not after the runs
    try:
        methods = [parse_method(m) for m in args.methods]
        task = SpecTask(args.task, hidden=args.hidden, batch=args.batch)
    except (ValueError, TaskError) as e:
        raise SystemExit(f"error: {e}") from None
    torch.set_num_threads(max(1, torch.get_num_threads()))
    setup = Setup(args.task, args.hidden, args.workers, args.steps, args.batch, args.weight_decay, points)
    started = time.monotonic()
    runs = run_all(methods, task, setup, seeds=range(args.seeds), lr=args.lr, lr_sweep=sweep,
                   sweep_seed=args.sweep_seed, sweep_step=args.sweep_step, window=args.window, cache=RunCache(args.cache),
                   log=lambda line: print(line, flush=True))
    rows = summarize(runs, window=args.window, target=target, points=points)
    print(f"\n{args.task}, {args.workers} workers, {args.steps} steps, batch {args.batch}/worker, {args.seeds} seeds, "
          f"training loss smoothed over {args.window} steps (mean ± sd over seeds), "
          f"{time.monotonic() - started:.0f} s\n")
    print(format_summary(rows, window=args.window, target=target, points=points, steps=args.steps,
                         baseline=methods[0].name))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "target_step": target, "eval_at": points, "summary": [asdict(s) for s in rows],
              "runs": [{"method": r.method.name, "lr": r.lr, "sweep": r.sweep, "outcomes": [asdict(o) for o in r.outcomes]}
                       for r in runs]}
    if (aside := keep_previous_report(args.out)) is not None:
        print(f"the previous report is kept as {aside}")
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nJSON: {args.out}")
    return rows


if __name__ == "__main__":
    main()
