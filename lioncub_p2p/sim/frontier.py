"""The bits–quality frontier (issue 15 §2) from ``lioncub-compare`` reports: loss at equal steps and
at equal wall time against bits per parameter per step, as a table and a plot.

Wall time is *computed*, not run through the network simulator: seconds per step = one peer's
forward + backward (measured in the runs: every peer computes in parallel) + the butterfly rounds
at the given links. A round moves each part's votes to its reducer and the results back; parts are
sized by upload rate (``lioncub-sim`` passes ``--weight`` = upload Mbit/s). With peer i reducing a
share fᵢ of P parameters, b upload bits and r result bits per parameter:

    votes   = maxᵢ max((1 − fᵢ)·P·b / upᵢ, (n − 1)·fᵢ·P·b / downᵢ)
    results = maxᵢ max((n − 1)·fᵢ·P·r / upᵢ, (1 − fᵢ)·P·r / downᵢ)

A momentum sync is one more round at 16 + 16 bits (bf16) over the synced elements; global Lion is
the same butterfly over fp32 gradients (32 + 32), the best case for full precision. Latency,
framing and stragglers are left out: measured rounds (docs/benchmarks.md) take 1.1–1.3× this.

    python -m lioncub_p2p.sim.frontier runs/quality/frontier.json --png docs/frontier.png
"""
from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..codecs import result_codec, upload_codec
from . import quality
from .inprocess import parse_method
from .links import LinkProfile, parse_links
from .variants import Options

SIM_LINKS = "100,50,20,10"  # lioncub-sim's default links


def round_seconds(numel: int, up_bits: float, down_bits: float, links: Sequence[LinkProfile]) -> float:
    """One butterfly round of ``numel`` parameters (see the module docstring)."""
    n = len(links)
    weights = [link.up_mbit for link in links]
    shares = [w / sum(weights) for w in weights]
    votes = max(max((1 - f) * numel * up_bits / (link.up_mbit * 1e6), (n - 1) * f * numel * up_bits / (link.down_mbit * 1e6))
                for f, link in zip(shares, links))
    results = max(max((n - 1) * f * numel * down_bits / (link.up_mbit * 1e6),
                      (1 - f) * numel * down_bits / (link.down_mbit * 1e6)) for f, link in zip(shares, links))
    return votes + results


@dataclass(frozen=True)
class Traffic:
    """What one step moves, per parameter: the vote round's bits, and the bf16 momentum rounds."""

    vote_up: float
    vote_down: float
    sync_rounds_per_step: float  # bf16 rounds of all parameters, on average
    fp32: bool = False


def traffic(spec: str, workers: int, steps: int) -> Traffic:
    method = parse_method(spec)
    if method.upload is None:
        return Traffic(32.0, 32.0, 0.0, fp32=True)
    up = upload_codec(method.upload)
    down = result_codec(method.result).bits_per_element(workers * up.max_code)
    Options.of(method.variant)  # refuses unknown options
    return Traffic(up.bits_per_element, down, method.momentum.syncs_per_step(steps))  # streamed: 1/K round a step


def step_seconds(t: Traffic, numel: int, compute_s: float, links: Sequence[LinkProfile]) -> float:
    vote = round_seconds(numel, t.vote_up, t.vote_down, links)
    return compute_s + vote + t.sync_rounds_per_step * round_seconds(numel, 16.0, 16.0, links)


@dataclass
class Point:
    method: str
    lr: float
    bits: float  # up + down per parameter per step, as lioncub-compare counts them
    upload_bits: float
    seconds_per_step: float
    seconds_per_step_fast: float  # with compute 10× faster (a GPU-class peer)
    loss_at_steps: list  # per seed: smoothed training loss at the last step
    gap_at_steps: list  # per seed: against the baseline, paired
    steps_at_time: int  # steps this method makes in the equal-time budget
    loss_at_time: list
    steps_at_time_fast: int
    loss_at_time_fast: list


def frontier(report: dict, *, links: Sequence[LinkProfile], numel: int, window: int) -> list[Point]:
    """Points of one lioncub-compare report (its first method is the baseline)."""
    config = report["config"]
    workers, steps = config["workers"], config["steps"]
    compute = sorted(o["compute_s"] for r in report["runs"] for o in r["outcomes"])
    compute_s = compute[len(compute) // 2]
    base = {o["seed"]: o for o in report["runs"][0]["outcomes"]}
    rows = []
    for r in report["runs"]:
        t = traffic(r["method"], workers, steps)
        rows.append((r, step_seconds(t, numel, compute_s, links), step_seconds(t, numel, compute_s / 10, links)))
    budget = steps * min(s for _, s, _ in rows)  # the fastest method's time for all its steps
    budget_fast = steps * min(s for _, _, s in rows)
    points = []
    for r, seconds, fast in rows:
        losses = [[c[1] for c in o["curve"]] for o in r["outcomes"]]
        at_time = min(steps, int(budget / seconds))
        at_time_fast = min(steps, int(budget_fast / fast))
        end = [quality.smoothed_at(x, steps, window) for x in losses]
        gaps = [quality.relative_gap(e, quality.smoothed_at([c[1] for c in base[o["seed"]]["curve"]], steps, window))
                for e, o in zip(end, r["outcomes"]) if o["seed"] in base]
        points.append(Point(r["method"], r["lr"], quality.mean_spread([o["bits_per_element_per_step"] for o in r["outcomes"]])[0],
                            quality.mean_spread([o["upload_bits"] for o in r["outcomes"]])[0], seconds, fast, end, gaps,
                            at_time, [quality.smoothed_at(x, at_time, min(window, at_time)) for x in losses],
                            at_time_fast, [quality.smoothed_at(x, at_time_fast, min(window, at_time_fast)) for x in losses]))
    return points


def table(points: Sequence[Point], *, steps: int, baseline: str) -> str:
    head = ["method", "lr", "bits/param/step (up+down)", "upload bits", f"train loss @ step {steps}",
            f"gap vs {baseline}", "s/step (as measured)", "train loss @ equal time (steps)",
            "s/step (compute ÷10)", "train loss @ equal time (steps)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        lines.append(f"| {p.method} | {p.lr:g} | {p.bits:.2f} | {p.upload_bits:.2f} | {quality.fmt(p.loss_at_steps)} | "
                     f"{quality.fmt(p.gap_at_steps, 1, percent=True)} | {p.seconds_per_step:.3f} | "
                     f"{quality.fmt(p.loss_at_time)} ({p.steps_at_time}) | {p.seconds_per_step_fast:.3f} | "
                     f"{quality.fmt(p.loss_at_time_fast)} ({p.steps_at_time_fast}) |")
    return "\n".join(lines)


def plot(points: Sequence[Point], path: Path, *, steps: int, baseline: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    panels = ((axes[0], "gap", f"train loss at step {steps} vs {baseline} (%), mean ± sd over seeds"),
              (axes[1], "time", "train loss at equal wall time (computed, links 100/50/20/10 Mbit/s)"))
    for ax, kind, label in panels:
        for p in points:
            values = [100 * g for g in p.gap_at_steps] if kind == "gap" else p.loss_at_time
            mean, sd = quality.mean_spread(values)
            if not math.isfinite(mean):
                continue
            marker = "s" if p.method == baseline else ("^" if "+" in p.method.split("/", 1)[-1] else "o")
            ax.errorbar(p.bits, mean, yerr=sd, fmt=marker, capsize=3)
            ax.annotate(p.method, (p.bits, mean), textcoords="offset points", xytext=(4, 3), fontsize=6.5)
        ax.set(xscale="log", xlabel="bits per parameter per step (up + down; momentum syncs included)", ylabel=label)
        ax.grid(alpha=0.3, which="both")
    axes[0].axhline(0, color="grey", lw=0.8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lioncub_p2p.sim.frontier", description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", type=Path, help="lioncub-compare JSON reports (same task and setup)")
    p.add_argument("--links", default=SIM_LINKS, help="per-peer Mbit/s, as lioncub-sim --links")
    p.add_argument("--window", type=int, default=20, help="steps in the smoothed training loss")
    p.add_argument("--png", type=Path, default=None, help="write the plot here")
    p.add_argument("--json", type=Path, default=None, help="write the points here")
    args = p.parse_args(argv)
    try:
        links = parse_links(args.links)
        reports = [json.loads(path.read_text()) for path in args.reports]
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    merged = dict(reports[0])
    seen = {r["method"] for r in merged["runs"]}
    merged["runs"] = list(merged["runs"]) + [r for rep in reports[1:] for r in rep["runs"] if r["method"] not in seen]
    config = merged["config"]
    from ..tasks import load_task

    model = load_task(config["task"], seed=0, hidden=config["hidden"], batch=config["batch"]).model
    numel = sum(q.numel() for q in model.parameters())
    points = frontier(merged, links=links, numel=numel, window=args.window)
    baseline = merged["runs"][0]["method"]
    print(f"{config['task']} (hidden {config['hidden']}, {numel} parameters), {config['workers']} workers, "
          f"{config['steps']} steps, links {args.links} Mbit/s\n")
    print(table(points, steps=config["steps"], baseline=baseline))
    if args.png:
        plot(points, args.png, steps=config["steps"], baseline=baseline,
             title=f"{config['task']} {numel / 1e3:.0f}k parameters, {config['workers']} peers, batch "
                   f"{config['batch']}/peer, {len(merged['runs'][0]['outcomes'])} seeds, each method at its best lr")
        print(f"\nplot: {args.png}")
    if args.json:
        from dataclasses import asdict

        args.json.write_text(json.dumps([asdict(pt) for pt in points], indent=1))


if __name__ == "__main__":
    main()
