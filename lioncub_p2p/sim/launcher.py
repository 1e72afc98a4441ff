"""lioncub-sim: n local peers as separate processes (the volunteers' own code), uneven links, and the
methods side by side: same model, data, peers, links and seed.

    lioncub-sim --links 100,50,20,10 --methods lioncub lioncub-l1 hivemind-fp32 hivemind-fp16 dlion

Each method starts a coordinator and n ``lioncub-train`` processes (in their network namespaces as
root, else on 127.0.0.1 with no shaping: the report says which), applies the flakiness schedule,
and reads the peers' metrics. Bytes on the wire are read from each peer's interface counters in
namespace mode (everything, TCP and libp2p included), else from what the protocol counted.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from .. import failpoints
from ..aio import BackgroundLoop
from ..swarm import snapshot
from . import quality
from .links import LinkProfile, NamespaceNetwork, namespaces_available, parse_links
from .proxy import ShapingProxy

logger = logging.getLogger("lioncub.sim")


@dataclass(frozen=True)
class Method:
    label: str
    trainer_args: tuple[str, ...]


METHODS = {
    # the library's defaults (momentum streamed 1/20 per step in fp8): the main comparison
    "lioncub-default": Method("Lion Cub 1-bit majority, momentum streamed 1/20 in fp8 (default)",
                              ("--method", "lioncub", "--upload", "sign", "--result", "majority")),
    "lioncub-l1-default": Method("Lion Cub L1 4-bit, majority, momentum streamed 1/20 in fp8 (default)",
                                 ("--method", "lioncub", "--upload", "l1:4", "--result", "majority")),
    "lioncub": Method("Lion Cub 1-bit majority, momentum avg/25",
                      ("--method", "lioncub", "--upload", "sign", "--result", "majority", "--momentum-every", "25",
                       "--momentum-wire", "bf16")),
    "lioncub-l1": Method("Lion Cub L1 4-bit, majority, momentum avg/25",
                         ("--method", "lioncub", "--upload", "l1:4", "--result", "majority", "--momentum-every", "25",
                          "--momentum-wire", "bf16")),
    "hivemind-fp32": Method("full-precision Lion, hivemind averager fp32", ("--method", "hivemind-fp32",)),
    "hivemind-fp16": Method("full-precision Lion, hivemind averager fp16", ("--method", "hivemind-fp16",)),
    "dlion": Method("D-Lion all-gather of 1-bit votes", ("--method", "dlion", "--momentum-every", "0")),
    "lioncub-nosync": Method("Lion Cub 1-bit majority, no momentum sync",
                             ("--method", "lioncub", "--upload", "sign", "--result", "majority", "--momentum-every", "0")),
    "lioncub-nosync-plain": Method("Lion Cub 1-bit majority, no momentum sync, results never sent as deltas",
                                   ("--method", "lioncub", "--upload", "sign", "--result", "majority",
                                    "--momentum-every", "0", "--no-result-deltas")),
    "lioncub-stream": Method("Lion Cub 1-bit majority, momentum streamed 1/25 per step",
                             ("--method", "lioncub", "--upload", "sign", "--result", "majority", "--momentum-slices", "25",
                              "--momentum-wire", "bf16")),
    "lioncub-stream-fp8": Method("Lion Cub 1-bit majority, momentum streamed 1/25 per step in fp8",
                              ("--method", "lioncub", "--upload", "sign", "--result", "majority", "--momentum-slices", "25",
                               "--momentum-wire", "fp8")),
    "lioncub-overlap": Method("Lion Cub 1-bit majority, momentum avg/25, overlapped (delay 1)",
                              ("--method", "lioncub", "--upload", "sign", "--result", "majority", "--momentum-every", "25",
                               "--momentum-wire", "bf16", "--delay", "1")),
    "lioncub-nosync-overlap": Method("Lion Cub 1-bit majority, no momentum sync, overlapped (delay 1)",
                                     ("--method", "lioncub", "--upload", "sign", "--result", "majority",
                                      "--momentum-every", "0", "--delay", "1")),
}
DEFAULT_METHODS = ["lioncub-default", "lioncub-l1-default", "hivemind-fp32", "hivemind-fp16", "dlion"]


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


class Simulation:
    def __init__(self, profiles: list[LinkProfile], *, shaping: str, workdir: Path, hidden: int, batch: int,
                 steps: int, seconds: float, lr: float, eval_every: int, timeouts: tuple[float, float],
                 linger: float = 60.0, max_group: int = 0):
        self.profiles, self.workdir, self.linger, self.max_group = profiles, workdir, linger, max_group
        self.hidden, self.batch, self.steps, self.seconds, self.lr = hidden, batch, steps, seconds, lr
        self.eval_every, self.timeouts = eval_every, timeouts
        self.net: NamespaceNetwork | None = None
        self.proxy: ShapingProxy | None = None
        self._proxy_loop: BackgroundLoop | None = None
        self.notes: list[str] = []
        if shaping in ("auto", "netns"):
            ok, why = namespaces_available()
            if ok:
                self.net = NamespaceNetwork(profiles)
                self.net.setup()
                self.notes += self.net.notes
            elif shaping == "netns":
                raise SystemExit(f"error: network namespaces unavailable: {why}")
            else:
                self.notes.append(f"network namespaces unavailable ({why}): shaping in user space (proxy)")
                shaping = "proxy"
        if shaping == "proxy":
            self.proxy = ShapingProxy(profiles)
            self._proxy_loop = BackgroundLoop("shaping-proxy")
            self._proxy_loop.run(self.proxy.start(), timeout=30)
            if any(p.loss_pct for p in profiles):
                self.notes.append("loss not applied: a user-space TCP proxy cannot drop packets")
        elif shaping == "none":
            self.notes.append("links NOT shaped (--shaping none): peers run on 127.0.0.1 at full speed")
        self.shaping = "netns" if self.net else shaping
        self.procs: list[subprocess.Popen] = []
        self.latency_procs: list[subprocess.Popen] = []
        if self.net is not None and any(p.delay_ms for p in profiles):
            self._start_latency_proxies()

    NS_LISTEN, NS_ANNOUNCE = 40001, 40002  # ports inside each peer's namespace (its own port space)

    def _start_latency_proxies(self) -> None:
        """Delay-only proxies, one inside each peer's namespace; the kernel still enforces the rates."""
        n = len(self.profiles)
        addresses = ",".join(self.net.address(i) for i in range(n))
        profiles = json.dumps([asdict(p) for p in self.profiles])
        for i in range(n):
            argv = self.net.exec_prefix(i) + [sys.executable, "-m", "lioncub_p2p.sim.proxy", "--serve", str(i),
                                              "--addresses", addresses, "--profiles", profiles,
                                              "--listen-port", str(self.NS_LISTEN), "--announce-port",
                                              str(self.NS_ANNOUNCE)]
            self.latency_procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                       start_new_session=True))
        self.notes.append("latency added by a user-space proxy in each peer's namespace (delays what it receives)")

    def close(self) -> None:
        for proc in self.procs + self.latency_procs:
            _kill_group(proc)
        self.procs.clear()
        self.latency_procs.clear()
        if self.net is not None:
            self.net.teardown()
            self.net = None
        if self._proxy_loop is not None:
            self._proxy_loop.run(self.proxy.stop(), timeout=10)
            self._proxy_loop.stop()
            self._proxy_loop = None

    def _spawn(self, who: int | str, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        prefix = self.net.exec_prefix(who) if self.net else []
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {}))
        proc = subprocess.Popen(prefix + [sys.executable, "-m", *argv], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def _host(self, who: int | str) -> str:
        if self.net and self.latency_procs and who != "c":
            return f"/ip4/{self.net.address(who)}/tcp/{self.NS_LISTEN}"
        if self.net:
            return f"/ip4/{self.net.address(who)}/tcp/0"
        if self.proxy is not None and who != "c":
            return self.proxy.listen_maddr(int(who))
        return "/ip4/127.0.0.1/tcp/0"

    def _set_link(self, i: int, up: bool, seconds: float) -> None:
        if self.net is not None:
            self.net.set_link(i, up)
        elif self.proxy is not None and not up:
            self.proxy.cut(i, seconds)
        elif not up:
            logger.warning("peer %d: a link cut needs shaping (namespaces or the proxy); not applied", i)

    def _counters(self, n: int) -> list[tuple[int, int]] | None:
        if self.net is not None:
            return [self.net.wire_bytes(i) for i in range(n)]
        if self.proxy is not None:
            return list(zip(self.proxy.sent, self.proxy.received))
        return None

    def run(self, name: str) -> MethodResult:
        method = METHODS[name]
        out = self.workdir / name
        shutil.rmtree(out, ignore_errors=True)  # metrics files are appended to: start clean
        out.mkdir(parents=True)
        maddrs = out / "coordinator.maddrs"
        self._spawn("c", ["lioncub_p2p.cli.coordinator", "--run-id", name, "--host-maddrs", self._host("c"),
                          "--write-maddrs", str(maddrs), "--quiet"], out / "coordinator.log")
        deadline = time.monotonic() + 60
        while not maddrs.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        n = len(self.profiles)
        started = time.monotonic()
        peers = [None if self.profiles[i].join_at is not None else self._start_peer(name, method, i, out, maddrs)
                 for i in range(n)]
        counters = self._follow(name, method, peers, out, maddrs)
        logger.info("%s: %.0f s from launch to the last peer's exit", name, time.monotonic() - started)
        for proc in self.procs:
            _kill_group(proc)
        self.procs.clear()
        source = ("interface counters during training (all traffic: votes, momentum, DHT, TCP)" if self.net else
                  "proxy counters during training (peer-to-peer traffic, payload above TCP)")
        result = summarize(name, method, out, n, counters, self.hidden, source)
        result.exit_codes = [p.returncode if p is not None else None for p in peers]
        result.final_steps, result.identical_final_params = final_agreement(out, n)
        return result

    def _start_peer(self, name: str, method: Method, i: int, out: Path, maddrs: Path) -> subprocess.Popen:
        profile = self.profiles[i]
        announce = ["--announce-maddrs", self.proxy.announce_maddr(i)] if self.proxy is not None else []
        if self.latency_procs:
            announce = ["--announce-maddrs", f"/ip4/{self.net.address(i)}/tcp/{self.NS_ANNOUNCE}"]
        argv = ["lioncub_p2p.cli.train", "--run-id", name, "--initial-peers-file", str(maddrs), *announce,
                "--host-maddrs", self._host(i), "--weight", str(profile.up_mbit), "--steps", str(self.steps),
                "--max-seconds", str(self.seconds), "--hidden", str(self.hidden), "--batch", str(self.batch),
                "--lr", str(self.lr), "--seed", "0", "--group-size", str(len(self.profiles)), "--quiet",
                "--eval-every", str(self.eval_every), "--upload-timeout", str(self.timeouts[0]),
                "--result-timeout", str(self.timeouts[1]), "--linger", str(self.linger),
                "--metrics-jsonl", str(out / f"peer{i}.jsonl"),
                "--wait-peers", str(sum(p.join_at is None for p in self.profiles))
                if not method.trainer_args[1].startswith("hivemind") else "0",
                "--final-eval", str(out / f"peer{i}.eval.json"), "--final-state", str(out / f"peer{i}.state"),
                *(["--max-group", str(self.max_group)] if self.max_group else []), *method.trainer_args]
        env = {failpoints.ENV: profile.failpoint} if profile.failpoint else {}
        if profile.hang_at is not None:
            env[failpoints.HANG_ENV] = f"{profile.hang_at}:{profile.hang_s}"
        return self._spawn(i, argv, out / f"peer{i}.log", env)

    def _follow(self, name: str, method: Method, peers: list[subprocess.Popen], out: Path, maddrs: Path):
        """Wait for the peers, applying each profile's flakiness schedule as the swarm progresses.

        Returns each peer's interface byte counters over the training phase (from the moment every
        peer logged its first step to the first peer's exit), or None without namespaces."""
        done_by = time.monotonic() + self.seconds + self.linger + 180
        stalled, left, back, cut = set(), set(), set(), {}
        window = TrainingWindow(lambda: self._counters(len(peers)))
        ended_at, kill_at, grace = None, float("inf"), 3.0
        running = lambda: [p for p in peers if p is not None]  # noqa: E731  (newcomers start later)
        while time.monotonic() < done_by and any(p.poll() is None for p in running()):
            if ended_at is None and any(p.poll() == 0 for p in running()):
                ended_at = time.monotonic()  # the budget is up: the others stop too, cleanly (SIGINT)
                if any(p is not None and p.poll() == 0 and _last_step(out / f"peer{i}.jsonl") >= self.steps - 1
                       for i, p in enumerate(peers)):  # it ended at the last step: others may linger for one
                    grace = self.linger + 10.0  # behind, and serve it the final state (trainers' --linger)
            if ended_at is not None and time.monotonic() - ended_at > grace:
                for p in running():
                    if p.poll() is None:
                        _signal_group(p, signal.SIGINT)
                # a stop signal lets the current step end, and a step's round may wait out both timeouts
                ended_at, kill_at = float("inf"), time.monotonic() + sum(self.timeouts) + 10
            if ended_at == float("inf") and time.monotonic() > kill_at:
                for p in running():  # stuck past what the timeouts allow: a bug, shown as exit code -9
                    _kill_group(p)
            steps = [_last_step(out / f"peer{i}.jsonl") for i in range(len(peers))]
            step = max(steps, default=-1)
            started = [s for s, p in zip(steps, peers) if p is not None]
            window.observe(steps, started, any(p.poll() is not None for p in running()))
            for i, profile in enumerate(self.profiles):
                if profile.join_at is not None and peers[i] is None and step >= profile.join_at and ended_at is None:
                    logger.info("%s: peer %d joins at step %d", name, i, step)
                    peers[i] = self._start_peer(name, method, i, out, maddrs)
                if profile.cut_at is not None and step >= profile.cut_at and i not in cut:
                    logger.info("%s: peer %d's link cut for %.0f s at step %d", name, i, profile.cut_s, step)
                    cut[i] = time.monotonic() + profile.cut_s
                    self._set_link(i, False, profile.cut_s)
                if cut.get(i) and time.monotonic() > cut[i]:
                    cut[i] = 0.0
                    self._set_link(i, True, 0.0)
                if peers[i] is None:
                    continue
                if profile.stall_at is not None and step >= profile.stall_at and i not in stalled:
                    stalled.add(i)
                    logger.info("%s: peer %d stalled (SIGSTOP) for %.0f s at step %d", name, i, profile.stall_s, step)
                    _signal_group(peers[i], signal.SIGSTOP)
                    time.sleep(0)  # resumed below once its time is up
                    peers[i].resume_at = time.monotonic() + profile.stall_s  # type: ignore[attr-defined]
                if i in stalled and getattr(peers[i], "resume_at", 0) and time.monotonic() > peers[i].resume_at:
                    _signal_group(peers[i], signal.SIGCONT)
                    peers[i].resume_at = 0  # type: ignore[attr-defined]
                if profile.leave_at is not None and step >= profile.leave_at and i not in left:
                    left.add(i)
                    logger.info("%s: peer %d killed (SIGKILL) at step %d", name, i, step)
                    _kill_group(peers[i])
                if profile.rejoin_at is not None and i in left and i not in back and step >= profile.rejoin_at:
                    back.add(i)
                    logger.info("%s: peer %d started again at step %d", name, i, step)
                    peers[i] = self._start_peer(name, method, i, out, maddrs)
            time.sleep(0.2)
        window.close([_last_step(out / f"peer{i}.jsonl") for i in range(len(peers))])
        return window.per_step()


class TrainingWindow:
    """Each peer's byte counters over the training phase: from the moment every started peer logged a
    step to the first peer's exit (after it, the others' rounds wait for a peer that left)."""

    def __init__(self, counters: Callable[[], list[tuple[int, int]] | None]):
        self.counters = counters
        self.first: tuple | None = None
        self.last: tuple | None = None

    def observe(self, steps: list[int], started: list[int], any_exited: bool) -> None:
        """One poll: every peer's last logged step, the started peers' ones, whether any has exited."""
        if self.first is None and started and min(started) >= 0:
            self.first = (self.counters(), steps)
        if self.first is not None and self.last is None and any_exited:
            self.last = (self.counters(), steps)

    def close(self, steps: list[int]) -> None:
        """After the last poll: peers that all exited between two polls (a short run, fp32 baselines
        that stop together) left no "last" reading; the counters outlive the processes, so take it now."""
        if self.first is not None and self.last is None:
            self.last = (self.counters(), steps)

    def per_step(self) -> list[tuple[float, float]] | None:
        """(bytes up, bytes down) per step and peer, or None without counters."""
        if self.first is None or self.last is None or self.first[0] is None or self.last[0] is None:
            return None
        return [((b[0] - a[0]) / max(s1 - s0, 1), (b[1] - a[1]) / max(s1 - s0, 1))
                for a, b, s0, s1 in zip(self.first[0], self.last[0], self.first[1], self.last[1])]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    _signal_group(proc, signal.SIGCONT)
    _signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _last_step(path: Path) -> int:
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


def summarize(name: str, method: Method, out: Path, n: int, counters, hidden: int,
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
        method=name, label=method.label, rounds=rounds,
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
        rows.append(f"| {r.label} | {r.rounds} | {_votes(r)} | {r.step_s:.3f} ({r.median_step_s:.3f} / {r.slowest_step_s:.2f}) | {r.compute_s:.3f} / "
                    f"{r.communication_s:.3f} / {r.waiting_s:.3f} | {(r.bytes_up_per_step + r.bytes_down_per_step) / 1e6:.3f} | "
                    f"{r.bits_per_param:.2f} ({_num(r.result_bits_per_param, 2)}) | {_num(r.train_loss_at_common_step)} | {_num(r.train_loss_at_common_time)} | "
                    f"{_num(r.seconds_to_target, 1)} | {r.final_eval_loss:.3f} ({r.final_eval_accuracy:.1f}) | "
                    f"{speed} | {r.divergence_events} | {_agreement(r)} |")
    return "\n".join(rows)


def _num(value: float | None, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if value is not None and value == value else "-"


def _votes(r: MethodResult) -> str:
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lioncub-sim", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--links", default="100,50,20,10", help="per-peer Mbit/s: '100,50' or up/down '100/20,50/50'")
    p.add_argument("--profile", default=None, help="YAML file: peers: [{up: 100, down: 100, loss: 0.5, ...}, ...]")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS), help="methods to compare")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width: 1024 -> 1.1M parameters, 2300 -> 5.5M")
    p.add_argument("--batch", type=int, default=32, help="samples per peer per step")
    p.add_argument("--steps", type=int, default=100000, help="stop each method at this step...")
    p.add_argument("--seconds", type=float, default=25.0, help="...or after this many seconds of training")
    p.add_argument("--lr", type=float, default=3e-4, help="Lion's learning rate")
    p.add_argument("--eval-every", type=int, default=5, help="evaluate every this many steps")
    p.add_argument("--window", type=int, default=10, help="steps in the smoothed training loss of the report")
    p.add_argument("--upload-timeout", type=float, default=10.0, help="trainers' --upload-timeout (seconds)")
    p.add_argument("--result-timeout", type=float, default=30.0, help="trainers' --result-timeout (seconds)")
    p.add_argument("--linger", type=float, default=60.0,
                   help="trainers' --linger: after --steps, how long peers stay up for one behind (a slow link "
                        "downloading the final state)")
    p.add_argument("--max-group", type=int, default=0,
                   help="trainers' --max-group: a two-level vote in groups of at most this many peers (0: flat)")
    p.add_argument("--shaping", choices=["auto", "netns", "proxy", "none"], default="auto",
                   help="auto: namespaces as root, else the user-space proxy; proxy also applies latency")
    p.add_argument("--out", type=Path, default=Path("runs/sim"), help="folder for the report, plot and peer logs")
    return p.parse_args(argv)


def load_profiles(profile: str | None, links: str) -> list[LinkProfile]:
    """The peers' links from ``--profile`` (YAML) or ``--links``; SystemExit with one line on any mistake."""
    if not profile:
        try:
            return parse_links(links)
        except ValueError as e:
            raise SystemExit(f"error: --links {links}: {e}") from None
    path = Path(profile)
    example = "peers: [{up: 100, down: 20}, {up: 50, delay: 40}]"
    try:
        spec = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: --profile {path} does not exist; write one like: {example}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: --profile {path} cannot be read ({getattr(e, 'strerror', None) or e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise SystemExit(f"error: --profile {path} is not valid YAML ({problem}{where}); write it like: {example}") from None
    if not isinstance(spec, dict) or "peers" not in spec:
        raise SystemExit(f"error: --profile {path} has no `peers:` list; write it like: {example}")
    extra = sorted(str(k) for k in spec if k != "peers")
    if extra:
        raise SystemExit(f"error: --profile {path}: unknown top-level field {extra[0]!r}; only `peers:` is read")
    peers = spec["peers"]
    if not isinstance(peers, list) or not peers:
        raise SystemExit(f"error: --profile {path}: `peers:` must be a non-empty list; write it like: {example}")
    profiles = []
    for i, peer in enumerate(peers):
        try:
            profiles.append(LinkProfile.from_dict(peer))
        except (ValueError, TypeError) as e:
            raise SystemExit(f"error: --profile {path}: peer {i}: {e}") from None
    return profiles


def main(argv: list[str] | None = None) -> None:
    run(argv)


def run(argv: list[str] | None = None) -> list[MethodResult]:
    args = parse_args(argv)
    if args.window < 1:
        raise SystemExit(f"error: --window {args.window}: the smoothing window needs at least 1 step")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    profiles = load_profiles(args.profile, args.links)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: --out {args.out} cannot be created ({e.strerror or e}); choose another folder")
    sim = Simulation(profiles, shaping=args.shaping, workdir=args.out, hidden=args.hidden, batch=args.batch,
                     steps=args.steps, seconds=args.seconds, lr=args.lr, eval_every=args.eval_every,
                     timeouts=(args.upload_timeout, args.result_timeout), linger=args.linger,
                     max_group=args.max_group)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    results = []
    try:
        links = ", ".join(f"{p.up_mbit:g}/{p.down_mbit:g}" for p in profiles)
        print(f"{len(profiles)} peers, links (up/down Mbit/s): {links}; shaping: {sim.shaping}; "
              f"model: MLP {args.hidden} wide on digits", flush=True)
        for note in sim.notes:
            print(f"  note: {note}", flush=True)
        for name in args.methods:
            print(f"running {name} ...", flush=True)
            results.append(sim.run(name))
            r = results[-1]
            print(f"  {r.rounds} rounds, {r.step_s:.3f} s/step, final eval loss {r.final_eval_loss:.3f}, "
                  f"votes counted per step: {_votes(r)}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: cleaning up", flush=True)
    finally:
        sim.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not results:
        return results
    points = compare(results, args.window)
    print(f"\ntraining loss: the peers' mean per step, smoothed over {points.window} steps (lioncub_p2p/sim/quality.py)")
    print(table(results, points))
    report = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "shaping": sim.shaping, "notes": sim.notes, "profiles": [asdict(p) for p in profiles],
              "quality_points": asdict(points), "results": [asdict(r) for r in results]}
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    (args.out / "report.md").write_text(table(results, points) + "\n")
    plot(results, args.out / "loss.png", args.window)
    print(f"\nreport: {args.out / 'report.json'}\nplot:   {args.out / 'loss.png'}", flush=True)
    return results


if __name__ == "__main__":
    main()
