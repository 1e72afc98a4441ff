"""lioncub-reliability: the reliability and security figures in one table (and JSON).

    lioncub-reliability [--soak-rounds 300] [--out runs/reliability.json]

1. bad voters (in process, digits): fewer than half of the voters send random bits, inverted votes
   or all ones; eval accuracy against an all-honest run, majority vote and L1 4-bit;
2. a lying reducer (LocalSwarm, audit rounds): how often it is caught when its part or audit is drawn;
3. faults (LocalSwarm): a peer killed mid-upload, before answering (reduction), mid-answer, stalled:
   survivors' updates bitwise equal and the round's wall time against its timeouts;
4. admission: a peer without the run secret trying to vote and to fetch results;
5. a flood of junk streams and oversized frames during a round;
6. soak: a real swarm with random churn for many rounds; faults, repairs, identical parameters;
7. process faults (``process_faults.py``): real trainer processes on shaped links, SIGKILLed at each
   protocol point (failpoints), SIGSTOPped, cut off, or on a 1 Mbit/s link: survivors' final
   parameters bitwise equal and their slowest step against the timeouts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .. import ops
from ..allreduce import VOTE_PROTOCOL, AllReduceConfig
from ..allreduce.admission import Admission
from ..momentum import MomentumSchedule
from ..testing import LocalSwarm, LyingReduction
from .inprocess import Method, run_method
from .process_faults import run_process_faults
from .soak import run_soak
from .tasks import digits_task

logger = logging.getLogger("lioncub.reliability")
CFG = AllReduceConfig(chunk_bytes=4096, upload_timeout=3.0, result_timeout=6.0, join_timeout=2.0, recovery_timeout=2.0)


def bad_voters(steps: int = 300) -> list[dict]:
    task, rows = digits_task(0), []
    sync = MomentumSchedule(every=10)
    for label, upload in (("1-bit majority", "sign"), ("L1 4-bit majority", "l1:4")):
        method = Method(label, upload, "majority", sync)
        honest = run_method(method, task, workers=5, steps=steps)
        rows.append(dict(method=label, bad="none", accuracy=honest.test_accuracy, loss=honest.test_loss, gap=0.0))
        for behavior in ("random", "invert", "ones"):
            bad = run_method(method, task, workers=5, steps=steps, byzantine={3: behavior, 4: behavior})
            rows.append(dict(method=label, bad=f"2 of 5 {behavior}", accuracy=bad.test_accuracy, loss=bad.test_loss,
                             gap=honest.test_accuracy - bad.test_accuracy))
    return rows


def _codes(n: int, numel: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [ops.pack_signs(torch.randn(numel, generator=g), seed=i) for i in range(n)]


def lying_reducer(rounds: int = 20) -> dict:
    with LocalSwarm(4, config=CFG) as swarm:
        swarm.nodes[1].reduction_factory = LyingReduction
        codes, drawn, caught, false_alarms = _codes(4, 8 * 4000), 0, 0, 0
        for step in range(rounds):
            swarm.allreduce(codes, step=step, audit=True)
            part, auditor, verdict = swarm.reports[0].audit
            if 1 in (part, auditor):
                drawn += 1
                caught += verdict == "mismatch"
            else:
                false_alarms += verdict == "mismatch"
        return dict(rounds=rounds, liar_drawn=drawn, caught=caught, detection_rate=caught / max(drawn, 1),
                    false_alarms=false_alarms, per_round_rate=caught / rounds)


def faults() -> list[dict]:
    rows, numel = [], 8 * 64_000
    cases = [("voter killed mid-upload", dict(kill=(2, "vote_chunk", 3))),
             ("reducer killed before answering", dict(kill=(1, "finalize", 1))),
             ("reducer killed mid-answer", dict(kill=(1, "result_chunk", 5))),
             ("peer stalled 8 s (SIGSTOP)", dict(stall=(2, 8.0)))]
    for label, fault in cases:
        with LocalSwarm(4, config=CFG) as swarm:
            codes = _codes(4, numel)
            swarm.allreduce(codes, step=0)  # warm connections
            if "kill" in fault:
                peer, event, after = fault["kill"]
                swarm.kill(peer, on=event, after=after)
            else:
                peer, seconds = fault["stall"]
                swarm.stall(peer, seconds)
            started = time.monotonic()
            results = swarm.allreduce(codes, step=1, timeout=120)
            wall = time.monotonic() - started
            survivors = [r for i, r in enumerate(results) if i != peer and r is not None]
            rows.append(dict(fault=label, survivors=len(survivors), identical=all(torch.equal(r, survivors[0])
                                                                                 for r in survivors),
                             round_s=wall, bound_s=CFG.result_timeout + CFG.recovery_timeout,
                             missing_parts=swarm.reports[0].missing_parts if swarm.reports[0] else None))
    return rows


def admission_and_flood() -> dict:
    """An outsider (no secret) tries to vote and fetch; junk streams and oversized frames hit every reducer."""
    from ..wire import PROTOCOL_VERSION, pb, write_frame
    from hivemind.p2p import PeerID

    out = {}
    with LocalSwarm(4, config=CFG) as swarm:
        admission = Admission("rel", b"secret")
        for node in swarm.nodes[:3]:
            node.admission = admission
        codes = _codes(4, 8 * 8000)
        seen = []
        handler = logging.Handler()
        handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[assignment]
        logging.getLogger("lioncub_p2p").addHandler(handler)
        try:
            results = swarm.allreduce(codes, step=0)  # peer 3 has no secret: its votes are refused
            out["outsider_refusals_logged"] = sum("not admitted" in m for m in seen)
            # in parts that members reduce (the outsider is in this test's group only to send its votes)
            out["outsider_counted"] = any(3 in p.counted for p in swarm.reports[0].parts if p.reducer != 3)
            out["members_identical"] = all(torch.equal(r, results[0]) for r in results[:3] if r is not None)
            for node in swarm.nodes:
                node.admission = Admission()

            async def flood(node, spec, codes):
                async def junk(j):
                    for _ in range(20):
                        try:
                            _, reader, writer = await node.p2p.call_binary_stream_handler(
                                PeerID.from_base58(spec.group[j].peer_id), VOTE_PROTOCOL)
                            writer.write((900 << 20).to_bytes(4, "big") + b"\0" * 64)
                            await writer.drain()
                            writer.close()
                        except Exception:
                            pass
                await asyncio.gather(*(junk(j) for j in range(3)))
                return await node.run_round(spec, codes)

            started = time.monotonic()
            swarm.allreduce(codes, step=1)
            clean = time.monotonic() - started
            started = time.monotonic()
            swarm.allreduce(codes, step=2, behaviors={3: flood})
            out["flood_round_s"], out["clean_round_s"] = time.monotonic() - started, clean
            out["flood_streams"] = 60
        finally:
            logging.getLogger("lioncub_p2p").removeHandler(handler)
    return out


def table(report: dict) -> str:
    lines = ["| check | result |", "|---|---|"]
    for row in report["bad_voters"]:
        lines.append(f"| {row['method']}, bad voters: {row['bad']} | test acc {row['accuracy']:.1f}% "
                     f"(gap to honest {row['gap']:+.1f} points) |")
    lr = report["lying_reducer"]
    lines.append(f"| lying reducer, audit every round | caught {lr['caught']} of {lr['liar_drawn']} rounds where its "
                 f"part or audit was drawn ({100 * lr['detection_rate']:.0f}%), {lr['false_alarms']} false alarms |")
    for row in report["faults"]:
        lines.append(f"| {row['fault']} | {row['survivors']} survivors, updates identical: {row['identical']}, "
                     f"round {row['round_s']:.1f} s (bound {row['bound_s']:.0f} s) |")
    adm = report["admission"]
    lines.append(f"| peer without the run secret | counted: {adm['outsider_counted']}, refusals logged: "
                 f"{adm['outsider_refusals_logged']}, members identical: {adm['members_identical']} |")
    lines.append(f"| {adm['flood_streams']} junk streams with 900 MiB frame headers during a round | round "
                 f"{adm['flood_round_s']:.2f} s vs {adm['clean_round_s']:.2f} s clean |")
    for row in report.get("process_faults", []):
        lines.append(f"| processes: {row['fault']} | {row['survivors']}/{row['expected']} survivors at step "
                     f"{row['steps']}, parameters identical: {row['identical']}, step median {row['median_step_s']:.2f} s"
                     f" / max {row['max_step_s']:.1f} s (bound {row['bound_s']:.0f} s), repairs {row['repairs']} |")
    soak = report["soak"]
    lines.append(f"| soak | {soak['rounds']} rounds in {soak['seconds']:.0f} s, faults {soak['faults']}, "
                 f"repairs {soak['repairs']}, unrepaired {soak['unrepaired']}, identical at end: "
                 f"{soak['identical_at_end']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    run(argv)


def run(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--soak-rounds", type=int, default=300)
    parser.add_argument("--steps", type=int, default=300, help="training steps of the bad-voter runs")
    parser.add_argument("--process-steps", type=int, default=150, help="steps of each process-fault scenario")
    parser.add_argument("--skip-process-faults", action="store_true", help="leave out the process scenarios (~8 min)")
    parser.add_argument("--out", type=Path, default=Path("runs/reliability.json"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    report = {}
    for name, run in (("bad_voters", lambda: bad_voters(args.steps)), ("lying_reducer", lying_reducer),
                      ("faults", faults), ("admission", admission_and_flood),
                      ("soak", lambda: asdict(run_soak(args.soak_rounds))),
                      ("process_faults", lambda: [] if args.skip_process_faults else run_process_faults(
                          args.out.parent / "process_faults", steps=args.process_steps))):
        started = time.monotonic()
        report[name] = run()
        print(f"{name}: done in {time.monotonic() - started:.0f} s", flush=True)
    print("\n" + table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nJSON: {args.out}")
    return report


if __name__ == "__main__":
    main()
