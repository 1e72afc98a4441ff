"""lioncub-plot: turn trainers' metrics (--metrics-jsonl files) into one PNG.

    lioncub-plot peer0.jsonl peer1.jsonl --out run.png

Panels: training loss against step and against wall-clock time, seconds per step split into
compute / communication / waiting, and bytes per step up and down.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import HelpFormatter, UsageError


REQUIRED = ("step", "loss", "time", "compute_s", "step_s")  # what every --metrics-jsonl line holds


def load(path: Path) -> list[dict]:
    """The metrics lines of a ``--metrics-jsonl`` file; UsageError if it holds none."""
    try:
        text = path.read_bytes().decode("utf-8")
    except IsADirectoryError:
        raise UsageError(f"{path} is a folder; give the --metrics-jsonl files themselves") from None
    except OSError as e:
        raise UsageError(f"{path} cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not a metrics file (binary data); give files written by "
                         f"lioncub-train --metrics-jsonl") from None
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if isinstance(row, dict) and all(isinstance(row.get(k), (int, float)) for k in REQUIRED):
            rows.append(row)
    if not rows:
        raise UsageError(f"{path} holds no metrics lines (each needs {', '.join(REQUIRED)}); give files written by "
                         f"lioncub-train --metrics-jsonl")
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


PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def run_name(path: Path, paths: list[Path]) -> str:
    """A run's label: its file name, with its folder where two files share the name (every peer of a
    simulator run writes peer0.jsonl in its method's folder), its whole path where that is shared too."""
    for name in (lambda p: p.stem, lambda p: f"{p.parent.name}/{p.stem}"):
        if sum(name(p) == name(path) for p in paths) == 1:
            return name(path)
    return str(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lioncub-plot", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("metrics", nargs="+", type=Path, help="files written by lioncub-train --metrics-jsonl")
    parser.add_argument("--out", type=Path, default=Path("metrics.png"), help="the PNG to write")
    args = parser.parse_args(argv)
    try:
        for path in args.metrics:
            if not path.exists():
                raise UsageError(f"{path} does not exist")
        if args.out.suffix.lower() not in PLOT_SUFFIXES:
            raise UsageError(f"--out {args.out}: use a {', '.join(PLOT_SUFFIXES)} file name")
        runs = {run_name(path, args.metrics): load(path) for path in args.metrics}
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("lioncub-plot needs matplotlib: pip install 'lioncub-p2p[sim]'") from None
        try:
            plot(runs, args.out)
        except OSError as e:
            raise UsageError(f"--out {args.out} cannot be written ({e.strerror or e}); choose another path") from None
    except UsageError as e:
        raise SystemExit(f"error: {e}")
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
