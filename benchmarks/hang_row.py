"""The process-faults hang rows, run N times one after another, with what docs/reliability.md tabulates.

For each run: whether the survivors ended identical; the seconds the other peers lost in steps over
1 s (median peer) and the hung peer's; the fewest steps of notice any peer had of a group epoch formed
mid-run (its "steps of notice" log lines) and how many of those a leader's notice brought before the
member's DHT read did ("pushed"); the "in another group" log lines (steps split between two
groups); and how often a part dropped voters it had refused before its round started. Needs network
namespaces (root) for shaped links, else runs on loopback.

    python benchmarks/hang_row.py [--runs 3] [--steps 600] [--flat] [--workdir /tmp/hang]
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from lioncub_p2p.sim.process_faults import SCENARIOS, run_scenario

NOTICE = re.compile(r"from step (\d+) (read|pushed) at step \d+ \((-?\d+) steps of notice")


def measure(folder: Path, peers: int, hung: int, steps: int) -> dict:
    slow, notices, split, refused, pushed = {}, [], 0, 0, 0
    for i in range(peers):
        rows = [json.loads(line) for line in (folder / f"peer{i}.jsonl").read_text().splitlines()]
        slow[i] = sum(r["step_s"] for r in rows[1:] if r["step_s"] > 1.0)
        log = (folder / f"peer{i}.log").read_text(errors="replace")
        # mid-run: not the start's groups, nor the closing group from the last step (nobody steps it)
        found = [(how, int(n)) for first, how, n in NOTICE.findall(log) if 0 < int(first) < steps]
        notices += [n for _, n in found]
        pushed += sum(how == "pushed" for how, _ in found)  # a leader's notice came before the DHT read
        split += log.count("in another group")
        refused += log.count("refused before this peer started")
    return dict(others_slow_s=round(statistics.median(v for i, v in slow.items() if i != hung), 1),
                hung_slow_s=round(slow[hung], 1), least_notice=min(notices, default=None),
                notices_pushed=f"{pushed}/{len(notices)}", split_lines=split,
                refused_voters_dropped=refused)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--flat", action="store_true", help="the one-group hang row instead of the two-level one")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/hang"))
    args = p.parse_args()
    prefix = "training thread hangs" if args.flat else "two-level: training thread hangs"
    scenario = next(s for s in SCENARIOS if s.label.startswith(prefix))
    hung = next(i for i, peer in enumerate(scenario.peers) if "hang_at" in peer)
    for k in range(args.runs):
        folder = args.workdir / f"run{k}"
        row = run_scenario(scenario, folder, steps=args.steps, hidden=512)
        print(json.dumps(dict(run=k, identical=row["identical"], max_step_s=round(row["max_step_s"], 2),
                              **measure(folder / "lioncub", len(scenario.peers), hung, args.steps))), flush=True)


if __name__ == "__main__":
    main()
