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
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from .. import failpoints
from ..aio import BackgroundLoop
from .links import LinkProfile, NamespaceNetwork, namespaces_available, parse_links
from .proxy import ShapingProxy
from .report_files import stamped
from .results import MethodResult, compare, final_agreement, last_logged_step, plot, summarize, table, votes_summary

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
        result = summarize(name, method.label, out, n, counters, self.hidden, source)
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
        armed = [j for j, p in enumerate(self.profiles) if j != i and (p.failpoint or "").startswith("serve")]
        if profile.join_at is not None and armed:  # a newcomer asks the armed donor first (its id from its log)
            found = re.search(r" as (\w+)", (out / f"peer{armed[0]}.log").read_text(errors="replace"))
            if found:
                env[failpoints.DONOR_ENV] = found.group(1)
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
                if any(p is not None and p.poll() == 0 and last_logged_step(out / f"peer{i}.jsonl") >= self.steps - 1
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
            steps = [last_logged_step(out / f"peer{i}.jsonl") for i in range(len(peers))]
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
        window.close([last_logged_step(out / f"peer{i}.jsonl") for i in range(len(peers))])
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


def check_numbers(args: argparse.Namespace) -> None:
    """One line for a number no trainer could run with, before anything starts or moves."""
    if args.window < 1:
        raise SystemExit(f"error: --window {args.window}: the smoothing window needs at least 1 step")
    for flag in ("hidden", "batch", "steps"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"error: --{flag} must be at least 1, got {getattr(args, flag)}")
    for flag in ("seconds", "lr", "upload_timeout", "result_timeout"):
        if not getattr(args, flag) > 0:  # (nan is not)
            raise SystemExit(f"error: --{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if not args.linger >= 0 or args.eval_every < 0 or args.max_group < 0:
        raise SystemExit("error: --linger, --eval-every and --max-group must be 0 or more")


def keep_previous(out: Path) -> Path | None:
    """Move an earlier run's report, plot and method folders in ``out`` into a folder of their own
    (each method's folder is emptied before it runs, and the report rewritten): nothing is lost.
    Returns that folder, or None when there was nothing."""
    found = [out / name for name in ("report.json", "report.md", "loss.png", *METHODS) if (out / name).exists()]
    if not found:
        return None
    aside = stamped(out, "previous-", max(p.stat().st_mtime for p in found))
    aside.mkdir()
    for path in found:
        path.rename(aside / path.name)
    return aside


def run(argv: list[str] | None = None) -> list[MethodResult]:
    args = parse_args(argv)
    check_numbers(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    profiles = load_profiles(args.profile, args.links)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        aside = keep_previous(args.out)
    except OSError as e:
        raise SystemExit(f"error: --out {args.out} cannot be created ({e.strerror or e}); choose another folder")
    if aside is not None:
        print(f"the previous results in {args.out} are kept in {aside} (delete it when done)", flush=True)
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
                  f"votes counted per step: {votes_summary(r)}", flush=True)
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
