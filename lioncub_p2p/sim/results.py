"""What one method's run measured, read from its peers' logs and final states (``summarize``,
``final_agreement``), and the methods compared side by side (``compare``, ``table``, ``plot``):
``lioncub-sim``'s report. Pure functions of files and numbers, tested without a network."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..swarm import snapshot
from . import quality

@dataclass
class MethodResult:
    method: str
    label: str
    rounds: int
    wall_s: float
    step_s: float  # mean time per step: wall time / steps (periodic momentum syncs included)
    median_step_s: float  # median gap between consecutive steps of a peer
    slowest_step_s: float  # the longest such gap (a whole-buffer momentum round shows here)
    compute_s: float
    communication_s: float
    waiting_s: float
    round_s: float  # median time of the vote round alone (our methods), inside the optimizer step
    bytes_up_per_step: float  # per peer
    bytes_down_per_step: float
    bits_per_param: float
    final_train_loss: float
    final_eval_loss: float
    final_eval_accuracy: float
    eval_loss_at_common_step: float | None = None
    train_loss_at_common_step: float | None = None  # the peers' mean loss per step, smoothed (quality.py)
    train_loss_at_common_time: float | None = None
    seconds_to_target: float | None = None  # until the smoothed loss first reaches the report's target
    votes_counted: dict = field(default_factory=dict)  # votes a step counted -> steps (lioncub, dlion)
    speedup_vs_fp32: float | None = None
    divergence_events: int = 0
    peers_finished: int = 0
    exit_codes: list = field(default_factory=list)  # per peer: 0 clean, -9 killed, None never started
    final_steps: list = field(default_factory=list)  # per peer, from its final state
    identical_final_params: bool | None = None  # every peer that ended at the last step, bitwise
    bytes_source: str = ""
    curves: dict = field(default_factory=dict)  # per peer 0: time, step, loss, eval points
    result_bits_per_param: float | None = None  # the result leg alone, as sent (deltas) ...
    plain_result_bits_per_param: float | None = None  # ... and as plain results would have been


def last_logged_step(path: Path) -> int:
    try:
        lines = path.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else -1
    except (FileNotFoundError, ValueError, KeyError, IndexError):
        return -1


def _jsonl(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows


def summarize(name: str, label: str, out: Path, n: int, counters, hidden: int,
              source: str = "interface counters during training (all traffic: votes, momentum, DHT, TCP)") -> MethodResult:
    numel = 64 * hidden + hidden + hidden * hidden + hidden + hidden * 10 + 10
    per_peer = [_jsonl(out / f"peer{i}.jsonl") for i in range(n)]
    rows = [r for peer in per_peer for r in peer]
    gaps = [b["time"] - a["time"] for peer in per_peer for a, b in zip(peer, peer[1:]) if b["step"] == a["step"] + 1]
    steps = [peer[-1]["step"] + 1 for peer in per_peer if peer]
    rounds = int(statistics.median(steps)) if steps else 0
    med = lambda values: statistics.median(values) if values else float("nan")  # noqa: E731
    if counters is not None:
        up, down = [c[0] for c in counters], [c[1] for c in counters]
    else:
        up = [med([r.get("bytes_up", 0) for r in peer]) for peer in per_peer]
        down = [med([r.get("bytes_down", 0) for r in peer]) for peer in per_peer]
        source = "protocol counters" if "bytes_up" in (rows[0] if rows else {}) else "not measured (hivemind, unshaped)"
    evals = []
    for i, peer in enumerate(per_peer):  # the final evaluation, else the peer's last logged one
        path = out / f"peer{i}.eval.json"
        if path.exists():
            evals.append(json.loads(path.read_text()))
        elif any("eval_loss" in r for r in peer):
            last = [r for r in peer if "eval_loss" in r][-1]
            evals.append({"eval_loss": last["eval_loss"], "eval_accuracy": float("nan")})
    first = per_peer[0] if per_peer and per_peer[0] else (rows[:1] if rows else [])
    t0 = first[0]["time"] if first else 0.0
    curves = {"time": [r["time"] - t0 for r in first], "step": [r["step"] for r in first],
              "loss": [r["loss"] for r in first],
              "eval_step": [r["step"] + 1 for r in first if "eval_loss" in r],
              "eval_loss": [r["eval_loss"] for r in first if "eval_loss" in r]}
    comm = [r["step_s"] - r.get("wait_s", 0.0) for r in rows]
    swarm = swarm_curve(per_peer, t0)
    curves.update(swarm)
    votes = [v for v in swarm["swarm_votes"] if v is not None]
    return MethodResult(
        method=name, label=label, rounds=rounds,
        wall_s=(first[-1]["time"] - t0) if first else 0.0,
        step_s=_mean_step(first, per_peer),
        median_step_s=med(gaps), slowest_step_s=max(gaps, default=float("nan")),
        compute_s=med([r["compute_s"] for r in rows]),
        communication_s=med(comm), waiting_s=med([r.get("wait_s", 0.0) for r in rows]),
        round_s=med([r["round_s"] for r in rows if "round_s" in r]),
        bytes_up_per_step=med(up), bytes_down_per_step=med(down),
        bits_per_param=8 * (med(up) + med(down)) / numel,
        final_train_loss=statistics.mean([r["loss"] for r in first[-10:]]) if first else float("nan"),
        final_eval_loss=statistics.mean([e["eval_loss"] for e in evals]) if evals else float("nan"),
        final_eval_accuracy=_finite_mean([e["eval_accuracy"] for e in evals]),
        divergence_events=sum(bool(r.get("repaired")) for r in rows), peers_finished=len(evals),
        votes_counted={str(k): votes.count(k) for k in sorted(set(votes), reverse=True)},
        bytes_source=source, curves=curves,
        result_bits_per_param=_leg_bits(rows, "result_down", numel),
        plain_result_bits_per_param=_leg_bits(rows, "result_plain", numel))


def _leg_bits(rows: list[dict], key: str, numel: int) -> float | None:
    """Bits per parameter that one peer receives per step on one counter, the mean over every
    peer's logged steps (None when the method logs no such counter)."""
    values = [r[key] for r in rows if key in r]
    return 8 * sum(values) / numel / max(len(values), 1) if values else None


def swarm_curve(per_peer: list[list[dict]], t0: float) -> dict[str, list]:
    """Per step from 1 to the last logged: the peers' mean training loss (a step nobody logged, e.g.
    while a peer repaired, repeats the last value), peer 0's seconds since ``t0`` (else the earliest
    peer's), and the votes the step counted (the largest count any peer reported; None for methods
    that do not report one, the hivemind baselines)."""
    means = quality.per_step_mean([[(r["step"], r["loss"]) for r in peer] for peer in per_peer])
    if not means:
        return {"swarm_step": [], "swarm_time": [], "swarm_loss": [], "swarm_votes": []}
    times: dict[int, float] = {}
    votes: dict[int, int] = {}
    for i, peer in enumerate(per_peer):
        for r in peer:
            if i == 0 or r["step"] not in times:
                times[r["step"]] = r["time"] - t0
            if isinstance(r.get("peers"), int) and r["peers"] > 0:
                votes[r["step"]] = max(votes.get(r["step"], 0), r["peers"])
    by_step = {step: loss for step, loss, _ in means}
    loss, when, out_loss, out_time, out_votes = means[0][1], 0.0, [], [], []
    for step in range(means[-1][0] + 1):
        loss, when = by_step.get(step, loss), times.get(step, when)
        out_loss.append(loss)
        out_time.append(when)
        out_votes.append(votes.get(step))
    return {"swarm_step": list(range(1, len(out_loss) + 1)), "swarm_time": out_time, "swarm_loss": out_loss,
            "swarm_votes": out_votes}


def final_agreement(out: Path, n: int) -> tuple[list[int | None], bool | None]:
    """Each peer's final step (None without a final state) and whether every peer that ended at the
    step most peers ended at holds bitwise the same parameters (None if fewer than two did)."""
    finals: list[tuple[int, bytes] | None] = []
    for i in range(n):
        try:
            finals.append(snapshot.step_and_params_digest((out / f"peer{i}.state").read_bytes()))
        except (FileNotFoundError, snapshot.SnapshotError):
            finals.append(None)
    steps = [f[0] if f else None for f in finals]
    last, at_last = _last_step_count(steps)
    digests = {f[1] for f in finals if f and f[0] == last}
    return steps, (len(digests) == 1) if at_last >= 2 else None


def _last_step_count(final_steps: list[int | None]) -> tuple[int | None, int]:
    """The final step most peers ended at (the later one on a tie), and how many did. The launcher
    stops peers on a clock, so one may stop a step after the others: its parameters hold one more
    update, and comparing the others is what says whether the swarm stayed together."""
    ended = [s for s in final_steps if s is not None]
    if not ended:
        return None, 0
    step = max(set(ended), key=lambda s: (ended.count(s), s))
    return step, ended.count(step)


def _finite_mean(values: list[float]) -> float:
    """Mean of the finite values (a peer stopped before its final evaluation logs no accuracy)."""
    finite = [v for v in values if math.isfinite(v)]
    return statistics.mean(finite) if finite else float("nan")


def _mean_step(first: list[dict], per_peer: list[list[dict]]) -> float:
    """Wall time per step of peer 0 while every peer was still training: once the first peer stops
    (its budget is up), the rounds that follow wait for it and are not representative."""
    ends = [peer[-1]["time"] for peer in per_peer if peer]
    window = [r for r in first if r["time"] < min(ends)] if ends else []
    if len(window) < 2:
        return float("nan")
    return (window[-1]["time"] - window[0]["time"]) / (len(window) - 1)


@dataclass(frozen=True)
class QualityPoints:
    """Where methods are compared: the last step all reached, the shortest training time, and the
    loss target every method reached (the worst method's final smoothed loss)."""

    step: int
    seconds: float
    target: float | None
    window: int


def compare(results: list[MethodResult], window: int = 10) -> QualityPoints:
    """Fill the cross-method columns: speedup against fp32, the smoothed training loss (peers' mean)
    at the last common step and at the shortest common time, the seconds to the common loss target,
    and the eval loss at the largest common eval step."""
    fp32 = next((r for r in results if r.method == "hivemind-fp32"), None)
    common = common_step(results)
    trained = [r for r in results if r.curves.get("swarm_loss")]
    points = QualityPoints(min((len(r.curves["swarm_loss"]) for r in trained), default=0),
                           min((r.curves["swarm_time"][-1] for r in trained), default=0.0),
                           max((quality.smoothed_at(r.curves["swarm_loss"], len(r.curves["swarm_loss"]), window)
                                for r in trained), default=None), window)
    for r in results:
        if fp32 is not None and r.step_s == r.step_s and r.step_s > 0:
            r.speedup_vs_fp32 = fp32.step_s / r.step_s
        at = [loss for step, loss in zip(r.curves["eval_step"], r.curves["eval_loss"]) if step <= common]
        r.eval_loss_at_common_step = at[-1] if at else None
        losses, times = r.curves.get("swarm_loss", []), r.curves.get("swarm_time", [])
        if not losses or not points.step:
            continue
        w = min(window, points.step)
        r.train_loss_at_common_step = quality.smoothed_at(losses, points.step, w)
        by_then = sum(1 for t in times if t <= points.seconds)
        r.train_loss_at_common_time = quality.smoothed_at(losses, by_then, min(window, by_then)) if by_then else None
        reached = quality.steps_to_reach(losses, points.target, w) if points.target is not None else None
        r.seconds_to_target = times[reached - 1] if reached is not None else None
    return points


def common_step(results: list[MethodResult]) -> int:
    """The largest step at which every method that logged evaluations has one."""
    return min((max(r.curves["eval_step"]) for r in results if r.curves["eval_step"]), default=0)


def table(results: list[MethodResult], points: QualityPoints) -> str:
    target = f"{points.target:.3f}" if points.target is not None else "-"
    rows = [f"| method | rounds | votes counted/step | s/step (median / slowest) | compute / comm / wait s (medians) | "
            f"MB up+down per step | bits/param (result leg) | train loss @ step {points.step} | train loss @ {points.seconds:.0f} s | "
            f"s to train loss {target} | final eval loss (acc %) | speedup vs fp32 | repairs | params equal |",
            "|" + "---|" * 14]
    for r in results:
        speed = f"{r.speedup_vs_fp32:.1f}x" if r.speedup_vs_fp32 else "-"
        rows.append(f"| {r.label} | {r.rounds} | {votes_summary(r)} | {r.step_s:.3f} ({r.median_step_s:.3f} / {r.slowest_step_s:.2f}) | {r.compute_s:.3f} / "
                    f"{r.communication_s:.3f} / {r.waiting_s:.3f} | {(r.bytes_up_per_step + r.bytes_down_per_step) / 1e6:.3f} | "
                    f"{r.bits_per_param:.2f} ({_num(r.result_bits_per_param, 2)}) | {_num(r.train_loss_at_common_step)} | {_num(r.train_loss_at_common_time)} | "
                    f"{_num(r.seconds_to_target, 1)} | {r.final_eval_loss:.3f} ({r.final_eval_accuracy:.1f}) | "
                    f"{speed} | {r.divergence_events} | {_agreement(r)} |")
    return "\n".join(rows)


def _num(value: float | None, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if value is not None and value == value else "-"


def votes_summary(r: MethodResult) -> str:
    """Votes counted per step: "4 (97%), 3 (3%)"; "-" for methods that count none (hivemind)."""
    total = sum(r.votes_counted.values())
    if not total:
        return "-"
    return ", ".join(f"{k} ({100 * v / total:.0f}%)" for k, v in r.votes_counted.items())


def _agreement(r: MethodResult) -> str:
    """Whether the peers that ended at the step most ended at hold the same parameters, and how many did."""
    if r.identical_final_params is None:
        return "-"
    last, at_last = _last_step_count(r.final_steps)
    return f"{'yes' if r.identical_final_params else 'NO'} ({at_last} at step {last})"


def plot(results: list[MethodResult], path: Path, window: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_step) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        loss = quality.smoothed(r.curves.get("swarm_loss", []), window)
        ax_time.plot(r.curves.get("swarm_time", []), loss, label=r.label)
        ax_step.plot(r.curves.get("swarm_step", []), loss, label=r.label)
    ylabel = f"train loss (peers' mean, smoothed over {window} steps)"
    ax_time.set(xlabel="wall-clock seconds", ylabel=ylabel, yscale="log")
    ax_step.set(xlabel="step", ylabel=ylabel, yscale="log")
    ax_step.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
