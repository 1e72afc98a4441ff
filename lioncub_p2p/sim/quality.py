"""Training-quality metrics shared by ``lioncub-compare`` and ``lioncub-sim``.

One evaluation at one step is noise (global Lion alone spans 0.127–0.161 in test loss at step 15
of the digits MLP over 6 seeds), so quality is read from the *training* loss, averaged over the
peers of each step and over a trailing window of steps, and compared across methods:

* ``smoothed_at(losses, k, w)``: mean of the losses of steps k−w+1 .. k (steps count from 1: the
  loss of step k is the one computed before the k-th update);
* ``steps_to_reach(losses, target, w)``: the first step whose smoothed loss is at or below
  ``target``; with ``target`` the baseline's smoothed loss at step K, ``steps / K`` is the headline
  ("this method needs 1.18× the steps of global Lion to reach its loss at step K");
* ``mean_spread``: mean and sample standard deviation over seeds.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def smoothed(losses: Sequence[float], window: int) -> list[float]:
    """Trailing means: entry k−1 is the mean of steps max(1, k−window+1) .. k."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, value in enumerate(losses):
        total += value
        if i >= window:
            total -= losses[i - window]
        out.append(total / min(i + 1, window))
    return out


def smoothed_at(losses: Sequence[float], step: int, window: int) -> float:
    """Mean loss of steps step−window+1 .. step (fewer at the start); NaN past the end."""
    if step < 1 or step > len(losses):
        return float("nan")
    chunk = losses[max(0, step - window) : step]
    return sum(chunk) / len(chunk)


def steps_to_reach(losses: Sequence[float], target: float, window: int, *, start: int | None = None) -> int | None:
    """The first step whose smoothed loss is <= ``target`` (None if never).

    ``start`` (default ``window``) is the first step considered: a trailing mean over fewer than a
    full window of steps is too noisy to count as having reached anything."""
    first = window if start is None else start
    for k, value in enumerate(smoothed(losses, window), start=1):
        if k >= first and value <= target:
            return k
    return None


def mean_spread(values: Sequence[float]) -> tuple[float, float]:
    """(mean, sample standard deviation) of the finite values; (NaN, NaN) if none, spread 0 for one."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return float("nan"), float("nan")
    return statistics.fmean(finite), (statistics.stdev(finite) if len(finite) > 1 else 0.0)


def relative_gap(value: float, baseline: float) -> float:
    """(value − baseline) / baseline: +0.05 is 5% worse than the baseline for a loss."""
    return (value - baseline) / baseline if baseline else float("nan")


def fmt(values: Sequence[float], digits: int = 3, *, percent: bool = False) -> str:
    """"mean ± sd" over seeds ("mean" alone for one seed)."""
    mean, sd = mean_spread(values)
    if not math.isfinite(mean):
        return "-"
    scale, unit = (100.0, "%") if percent else (1.0, "")
    sign = "+" if percent and mean >= 0 else ""
    text = f"{sign}{mean * scale:.{digits}f}{unit}"
    n = sum(1 for v in values if v is not None and math.isfinite(v))
    return text + (f" ± {sd * scale:.{digits}f}{unit}" if n > 1 else "")


def fmt_ratio(ratios: Sequence[float | None], limit: float) -> str:
    """Steps-to-reach ratios over seeds; a seed that never reached counts as "> limit"."""
    reached = [r for r in ratios if r is not None]
    if not ratios:
        return "-"
    if len(reached) < len(ratios):
        return f"> {limit:.2f} ({len(ratios) - len(reached)}/{len(ratios)} seeds never)"
    return fmt(reached, 2) + "×"


def per_step_mean(curves: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, float, int]]:
    """(step, mean loss, peers that logged it) for every step any peer logged, from per-peer
    (step, loss) lists: the swarm's training loss per step, as ``lioncub-compare`` records it."""
    by_step: dict[int, list[float]] = {}
    for curve in curves:
        for step, loss in curve:
            if math.isfinite(loss):
                by_step.setdefault(step, []).append(loss)
    return [(step, statistics.fmean(v), len(v)) for step, v in sorted(by_step.items())]
