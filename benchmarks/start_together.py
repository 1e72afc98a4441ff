"""Peers started at the same moment without ``--wait-peers``: how long until both are done, and the
slowest step (a first round that waits out the upload timeout shows here).

One ``lioncub-coordinator`` and ``--peers`` ``lioncub-train`` processes on loopback, started together,
for each source tree given (a ``git worktree`` of an older commit, and this one), ``--runs`` times
each, one after the other on the same machine:

    git worktree add /tmp/before f72a477
    python benchmarks/start_together.py /tmp/before . [--runs 3] [--steps 40] [--step-delay 0.1]
    python benchmarks/start_together.py . --peers 4 --wait-peers 4 --busy 2   # a busy volunteer's machine

Each line: wall time from starting the coordinator to every trainer's exit, the slowest step any
trainer logged (``step_s``), the trainers' exit codes and first steps, and whether they ended with
the same step and parameters (``snapshot.step_and_params_digest`` of ``--final-state``), and the most
voters any trainer's round counted. ``--busy N`` runs N processes spinning on a core meanwhile.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lioncub_p2p.swarm import snapshot


def run_once(tree: Path, peers: int, steps: int, step_delay: float, wait_peers: int = 0, busy: int = 0) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(tree.resolve()))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        return _run(env, peers, steps, step_delay, wait_peers)
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def _run(env: dict, peers: int, steps: int, step_delay: float, wait_peers: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="lioncub-together-") as tmp:
        work, started = Path(tmp), time.monotonic()
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "lioncub_p2p.cli.coordinator", "--run-id", "together", "--host-maddrs",
             "/ip4/127.0.0.1/tcp/0", "--write-maddrs", str(work / "c.maddrs")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env, cwd=work)
        trainers = [subprocess.Popen(
            [sys.executable, "-m", "lioncub_p2p.cli.train", "--run-id", "together", "--initial-peers-file",
             str(work / "c.maddrs"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--task", "digits", "--quiet",
             "--steps", str(steps), "--step-delay", str(step_delay), "--metrics-jsonl", str(work / f"m{i}.jsonl"),
             "--final-state", str(work / f"s{i}.state"), "--wait-peers", str(wait_peers)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env, cwd=work) for i in range(peers)]
        try:
            codes = [t.wait(300) for t in trainers]
        finally:
            for proc in trainers + [coordinator]:
                if proc.poll() is None:
                    proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(30)
        wall = time.monotonic() - started
        metrics = [work / f"m{i}.jsonl" for i in range(peers)]
        rows = [[json.loads(line) for line in m.read_text().splitlines() if line.strip()] if m.exists() else []
                for m in metrics]
        states = {snapshot.step_and_params_digest((work / f"s{i}.state").read_bytes())
                  for i in range(peers) if codes[i] == 0}
        return {"wall_s": wall, "slowest_step_s": max((r["step_s"] for peer in rows for r in peer), default=None),
                "exit_codes": codes, "first_steps": [peer[0]["step"] if peer else None for peer in rows],
                "equal": len(states) == 1 and all(c == 0 for c in codes),
                "max_peers": [max((r.get("peers", 0) for r in peer), default=0) for peer in rows]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+", type=Path, help="source trees to run (each must hold lioncub_p2p/)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-delay", type=float, default=0.1)
    p.add_argument("--wait-peers", type=int, default=0, help="passed to every trainer")
    p.add_argument("--busy", type=int, default=0, help="processes spinning on a core during each run")
    args = p.parse_args()
    for tree in args.trees:
        if not (tree / "lioncub_p2p").is_dir():
            p.error(f"{tree} holds no lioncub_p2p/: pass a checkout (git worktree add /tmp/before <commit>)")
        for k in range(args.runs):
            r = run_once(tree, args.peers, args.steps, args.step_delay, args.wait_peers, args.busy)
            slowest = "none" if r["slowest_step_s"] is None else f"{r['slowest_step_s']:.2f} s"
            print(f"{tree}: run {k}: wall {r['wall_s']:.1f} s, slowest step {slowest}, "
                  f"exit codes {r['exit_codes']}, first steps {r['first_steps']}, equal parameters {r['equal']}, "
                  f"most voters counted {r['max_peers']}",
                  flush=True)


if __name__ == "__main__":
    main()
