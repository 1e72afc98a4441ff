"""lioncub-plot: turn trainers' metrics (--metrics-jsonl files) into one PNG.

    lioncub-plot peer0.jsonl peer1.jsonl --out run.png

Panels: training loss against step and against wall-clock time, seconds per step split into
compute / communication / waiting, and bytes per step up and down.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a crash
    if not rows:
        raise SystemExit(f"error: {path} holds no metrics lines (is it a --metrics-jsonl file?)")
    return rows


def plot(runs: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (loss_step, loss_time), (split, traffic) = axes
    for name, rows in runs.items():
        t0 = rows[0]["time"]
        loss_step.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=name, alpha=0.8)
        loss_time.plot([r["time"] - t0 for r in rows], [r["loss"] for r in rows], label=name, alpha=0.8)
        traffic.plot([r["step"] for r in rows], [(r.get("bytes_up", 0) + r.get("bytes_down", 0)) / 1e6 for r in rows],
                     label=name, alpha=0.8)
    first = next(iter(runs.values()))
    steps = [r["step"] for r in first]
    compute = [r["compute_s"] for r in first]
    wait = [r.get("wait_s", 0.0) for r in first]
    comm = [max(r["step_s"] - r.get("wait_s", 0.0), 0.0) for r in first]
    split.stackplot(steps, compute, comm, wait, labels=["compute", "communication", "waiting"], alpha=0.8)
    loss_step.set(xlabel="step", ylabel="training loss", yscale="log")
    loss_time.set(xlabel="seconds", ylabel="training loss", yscale="log")
    split.set(xlabel="step", ylabel="seconds", title=f"time per step ({next(iter(runs))})")
    traffic.set(xlabel="step", ylabel="MB up + down per step")
    for ax in (loss_step, split):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("metrics.png"))
    args = parser.parse_args(argv)
    for path in args.metrics:
        if not path.exists():
            raise SystemExit(f"error: {path} does not exist")
    plot({path.stem: load(path) for path in args.metrics}, args.out)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
