"""Fixed per-round overhead of the swarm on loopback: 4 trainer processes with a tiny model.

With ~700 parameters (about 90 bytes of votes) the bytes cost nothing, so the median time of
``optimizer.step()`` (vote round + group upkeep + digest, no momentum sync) is the overhead a
round adds beyond moving its bytes. hivemind's matchmaking alone costs ~80 ms per step even with
a full group (measured on this machine before this project had its own rounds).

    python benchmarks/swarm_round.py [--peers 4] [--steps 80]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="lioncub-bench-"))
    print(f"metrics in {work}", flush=True)
    python = sys.executable
    procs = [subprocess.Popen([python, "-m", "lioncub_p2p.cli.coordinator", "--run-id", "bench",
                               "--write-maddrs", str(work / "a.maddrs")], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)]
    try:
        while not (work / "a.maddrs").exists():
            time.sleep(0.1)
        for i in range(args.peers):
            procs.append(subprocess.Popen(
                [python, "-m", "lioncub_p2p.cli.train", "--run-id", "bench", "--initial-peers-file",
                 str(work / "a.maddrs"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--steps", str(args.steps), "--hidden", "8", "--momentum-every", "0",
                 "--quiet", "--metrics-jsonl", str(work / f"t{i}.jsonl"), "--seed", str(i)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        for p in procs[1:]:
            p.wait(600)
    finally:
        for p in procs:
            try:  # the whole session: hivemind's DHT runs in forked children that outlive a killed parent
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    rows = []
    for i in range(args.peers):
        rows += [json.loads(line) for line in (work / f"t{i}.jsonl").read_text().splitlines()]
    full = [r for r in rows if r["group"] == args.peers and r["peers"] == args.peers and r["step"] >= 10]
    step_ms = statistics.median(r["step_s"] for r in full) * 1e3
    result = {"peers": args.peers, "params_bytes": "~90", "rounds_measured": len(full),
              "median_step_ms": step_ms, "p90_step_ms": statistics.quantiles([r["step_s"] for r in full], n=10)[-1] * 1e3}
    print(f"{args.peers} peers on 127.0.0.1, tiny model, {len(full)} full-group rounds: "
          f"median optimizer.step() {step_ms:.1f} ms, p90 {result['p90_step_ms']:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
