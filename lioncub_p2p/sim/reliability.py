"""lioncub-reliability: the reliability and security figures in one table (and JSON).

    lioncub-reliability [--soak-rounds 300] [--only attacks,faults] [--out runs/reliability.json]

1. bad voters (in process, digits): fewer than half of the voters send random bits, inverted votes
   or all ones; eval accuracy against an all-honest run, majority vote and L1 4-bit;
2. lying reducers (LocalSwarm): per-round catch rate of the voters' private audits against the
   formula, for a reducer lying in its whole part, in 1/8 of it, or to one voter only;
3. faults (LocalSwarm): a peer killed mid-upload, before answering (reduction), mid-answer, stalled:
   survivors' updates bitwise equal and the round's wall time against its timeouts;
4. admission: a peer without the run secret trying to vote and to fetch results;
5. a flood of junk streams and oversized frames during a round;
6. attacks on the round (issue 12, LocalSwarm): forged recovery answers, a reducer below the quorum,
   1e30 momenta, hundreds of idle streams, fake rounds, 1024 file descriptors, a trickling member,
   probe floods, idle streams at a donor, a leave mid-round;
7. soak: a real swarm with random churn for many rounds; faults, repairs, identical parameters;
8. process faults (``process_faults.py``): real trainer processes on shaped links, SIGKILLed at each
   protocol point (failpoints), SIGSTOPped, cut off, or on a 1 Mbit/s link: survivors' final
   parameters bitwise equal and their slowest step against the timeouts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import tempfile
import threading
import time
from dataclasses import asdict
from math import comb
from pathlib import Path

import torch

from .. import ops
from ..allreduce import AUDIT_PROTOCOL, FETCH_PROTOCOL, VOTE_PROTOCOL, AllReduceConfig
from ..allreduce.admission import Admission
from ..allreduce.audit import check_evidence
from ..allreduce.commit import leaf_bytes
from ..momentum import MomentumSchedule
from ..swarm.probe import BLOCK, MAX_PROBE_BYTES, PROBE_PROTOCOL, measure, serve_probe
from ..swarm.state_transfer import STATE_PROTOCOL, StateServer, download_state
from ..testing import (HugeMomentumReduction, LocalSwarm, PeakRss, cancel, fd_exhaustion, forge_fetch_answers,
                       hold_streams, lie_to, lying_reduction, rss_mib, start_outsider, trickler)
from ..wire import PROTOCOL_VERSION, pb, write_frame
from .inprocess import Method, run_method
from .report_files import check_report_path, keep_previous_report
from .process_faults import run_process_faults
from .soak import run_soak
from ..tasks.digits import digits_task

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


def _seeded(swarm: LocalSwarm, seed: int) -> None:
    for i, node in enumerate(swarm.nodes):
        node.audit_rng = random.Random(1000 * seed + i)


def _lie_catches(swarm: LocalSwarm, liar: int, by: list[int]) -> set[bytes]:
    liar_id = swarm.nodes[liar].peer_id
    return {c.round_id for i in by for c in swarm.nodes[i].catches if c.peer_id == liar_id and c.kind == "lie"}


def lying_reducers(rounds: int = 30, seeds: tuple[int, ...] = (0, 1, 2)) -> list[dict]:
    """Per-round catch rate of the voters' audits (4 peers, each audits one other part per round,
    opening 2 of its Merkle leaves) against the formula, for three kinds of liar."""
    n, leaves, liar = 4, 256, 1
    numel = 8 * n * 16 << 10  # parts of 16 KiB: 256 leaves of 64 bytes
    leaf = leaf_bytes(numel // 8 // n, 1)
    audited = 1 - (1 - 1 / (n - 1)) ** (n - 1)  # some honest voter audits the liar's part
    sneaky_leaves = leaves // 8
    hit = 1 - comb(leaves - sneaky_leaves, 2) / comb(leaves, 2)  # an audit opens one of the lied leaves
    kinds = [("lies in its whole part, every round", dict(probability=1.0), audited),
             ("lies in 1/8 of its part (32 leaves), every round", dict(probability=1.0, first_bytes=sneaky_leaves * leaf),
              1 - (1 - hit / (n - 1)) ** (n - 1)),
             ("lies to voter 3 only, every round", None, 1 / (n - 1))]
    rows = []
    for label, lie, predicted in kinds:
        lied = caught = 0
        first, false_alarms, evidence_ok = [], 0, True
        for seed in seeds:
            with LocalSwarm(n, config=CFG) as swarm:
                _seeded(swarm, seed)
                if lie is None:
                    lied_rounds = lie_to(swarm.nodes[liar], 3)
                    catchers = [3]
                else:
                    lying = lying_reduction(seed=seed, **lie)
                    swarm.nodes[liar].reduction_factory = lying
                    lied_rounds = lying.lies
                    catchers = [0, 2, 3]
                codes = _codes(n, numel)
                for step in range(rounds):
                    swarm.allreduce(codes, step=step)
                    swarm.settle_audits()
                got = _lie_catches(swarm, liar, catchers)
                steps = {rid: k for k, rid in enumerate(dict.fromkeys(lied_rounds))}  # lied round -> its number
                lied += len(steps)
                caught += len(got & set(steps))
                first.append(min((steps[r] for r in got if r in steps), default=None))
                liar_id = swarm.nodes[liar].peer_id
                false_alarms += sum(c.peer_id != liar_id for i in range(n) if i != liar for c in swarm.nodes[i].catches)
                proofs = [c.evidence for i in catchers for c in swarm.nodes[i].catches if c.kind == "lie"]
                evidence_ok &= all((check_evidence(e) or ("",))[0] == liar_id for e in proofs)
        rows.append(dict(liar=label, rounds_lied=lied, rounds_caught=caught, rate=caught / max(lied, 1),
                         predicted=predicted, first_catch=first, false_alarms=false_alarms, evidence_ok=evidence_ok))
    return rows


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


def _honest_agree(results, honest) -> bool:
    return all(results[i] is not None and torch.equal(results[i], results[honest[0]]) for i in honest)


def round_attacks(workdir: str) -> list[dict]:
    """Issue 12's attacks on the vote round and the stream services, each against real daemons."""
    rows, numel = [], 8 * 8000

    def row(attack: str, held: bool, outcome: str) -> None:
        rows.append(dict(attack=attack, held=held, outcome=outcome))
        print(f"  {attack}: {'held' if held else 'BROKEN'} ({outcome})", flush=True)

    # forged recovery answers for a dead reducer's part
    with LocalSwarm(5, config=CFG) as swarm:
        codes = _codes(5, numel)
        swarm.kill(1, on="finalize")
        refused = []
        for step, variant in enumerate(["own key", "reducer's key", "unsigned"]):
            forge_fetch_answers(swarm, 4, variant)
            results = swarm.allreduce(codes, step=step)
            refused.append(all(swarm.reports[i].parts[1].status == "missing" for i in (0, 2, 3))
                           and _honest_agree(results, [0, 2, 3]))
        row("a member forges recovery answers for a dead reducer's part (signed by itself, with the reducer's "
            "key and a bad signature, unsigned)", all(refused),
            "refused by all 3 honest survivors in each case; the part is zero for all, the rest identical")
    # a reducer left with its own vote (what slot exhaustion caused)
    with LocalSwarm(4, config=CFG) as swarm:
        node = swarm.nodes[1]
        node.admission = Admission(allow=frozenset({node.peer_id}))
        results = swarm.allreduce(_codes(4, numel))
        zero = all(swarm.reports[i].parts[1].status == "missing" for i in range(4)) and _honest_agree(results, [0, 1, 2, 3])
        row("a reducer counts only its own vote (every other voter refused)", zero,
            "below the quorum: no result; it applies zero there like everyone, updates identical")
    # 1e30 momenta
    g = torch.Generator().manual_seed(5)
    values = [torch.randn(4 * 3001, generator=g) for _ in range(4)]
    uploads = [v.to(torch.bfloat16).view(torch.uint8).unsqueeze(0) for v in values]
    with LocalSwarm(4, config=CFG) as swarm:
        swarm.nodes[1].reduction_factory = HugeMomentumReduction
        results = swarm.allreduce(uploads, upload="bf16", result="trimmed_mean")
        largest = max(float(results[i].nan_to_num().abs().max()) for i in (0, 2, 3))
        held = all(swarm.reports[i].parts[1].status == "missing" for i in (0, 2, 3)) and largest < 10
        row("a momentum reducer returns 1e30 for its whole part", held,
            f"refused by every receiver (above the bound its voters signed); they keep their own momenta there; "
            f"largest applied |value| {largest:.2f}")
    # hundreds of idle streams from an outsider, fresh dials every round
    fresh = AllReduceConfig(chunk_bytes=4096, upload_timeout=3.0, result_timeout=6.0, join_timeout=2.0,
                            recovery_timeout=2.0, keep_streams_s=0.0)
    with LocalSwarm(4, config=fresh) as swarm:
        codes = _codes(4, numel)
        swarm.allreduce(codes, step=0)
        clean = []
        for step in (1, 2):
            started = time.monotonic()
            swarm.allreduce(codes, step=step)
            clean.append(time.monotonic() - started)
        attacker = swarm.run(start_outsider(swarm))
        stop, victim = asyncio.Event(), swarm.nodes[1].peer_id
        floods = [asyncio.run_coroutine_threadsafe(hold_streams(attacker, victim, proto, 280, stop, redial=2.0),
                                                   swarm._loop.loop)
                  for proto in (VOTE_PROTOCOL, FETCH_PROTOCOL, AUDIT_PROTOCOL)]
        time.sleep(3.0)
        attacked, exact = [], True
        for step in (3, 4, 5):
            started = time.monotonic()
            results = swarm.allreduce(codes, step=step)
            attacked.append(time.monotonic() - started)
            exact &= _honest_agree(results, [0, 1, 2, 3]) and all(p.status == "ok" for p in swarm.reports[0].parts)
        swarm._loop.loop.call_soon_threadsafe(stop.set)
        dialed = sum(f.result(120) for f in floods)
        swarm.run(attacker.shutdown())
        refused = sum(gate.refused for gate in swarm.nodes[1].gates.values())
        row("an outsider holds 280 idle streams at a reducer's vote, fetch and audit handlers (re-dialing)", exact,
            f"{dialed} streams dialed, {refused} refused before a byte was read, 2 per handler held for the "
            f"{fresh.first_frame_timeout:.0f} s first-frame deadline; rounds exact, {max(attacked):.2f} s against {max(clean):.2f} s clean "
            f"(bound {fresh.result_timeout + fresh.recovery_timeout:.0f} s)")
    # fake rounds while a reducer is late
    with LocalSwarm(4, config=CFG) as swarm:
        codes = _codes(4, numel)
        swarm.allreduce(codes, step=0)
        attacker = swarm.run(start_outsider(swarm))
        late = swarm.nodes[0].peer_id

        def fake(k: int) -> bytes:
            body = pb.VoteChunk(version=PROTOCOL_VERSION, round_id=b"fake-%d" % k, part=0, length=8,
                                upload=pb.UPLOAD_SIGN, upload_bits=1, result=pb.RESULT_MAJORITY, codes=bytes(8)
                                ).SerializeToString()
            return len(body).to_bytes(4, "big") + body

        async def flood(p2p, until):
            await asyncio.gather(*(hold_streams(p2p, late, VOTE_PROTOCOL, 1, until, fake(k)) for k in range(20)))

        stop = asyncio.Event()
        floods = [asyncio.run_coroutine_threadsafe(flood(p2p, stop), swarm._loop.loop)
                  for p2p in (attacker, swarm.nodes[3].p2p)]
        time.sleep(1.5)
        results = swarm.allreduce(codes, step=1, delays={0: 0.8}, prepare=False)
        swarm._loop.loop.call_soon_threadsafe(stop.set)
        for f in floods:
            f.result(60)
        swarm.run(attacker.shutdown())
        counted = swarm.reports[1].parts[0].counted
        row("a member and an outsider ask for 20 fake rounds each while a reducer starts 0.8 s late",
            {0, 1, 2} <= set(counted) and _honest_agree(results, [0, 1, 2, 3]),
            f"each may wait for 2 rounds it names; the late reducer counted voters {counted}, updates identical")
    # file descriptors
    fd = fd_exhaustion(workdir, limit=1024, streams=700, rounds=5)
    row("an outsider holds 3 x 700 streams at a trainer limited to 1024 file descriptors",
        fd["exact"] == [True] * 5 and not fd["too_many_open_files"],
        f"{fd['dialed']} streams reached it; 'Too many open files': {'yes' if fd['too_many_open_files'] else 'no'}; "
        f"5 of 5 rounds exact: {fd['exact'] == [True] * 5}")
    # a trickling member
    behave, tasks = trickler(0.5)
    codes = _codes(5, 8 << 20)
    with LocalSwarm(5, client_mode=(4,), config=CFG) as swarm:
        rss, slowest = {}, 0.0
        for step in range(30):
            started = time.monotonic()
            results = swarm.allreduce(codes, step=step, behaviors={4: behave})
            slowest = max(slowest, time.monotonic() - started)
            rss[step] = rss_mib()
        agree = _honest_agree(results, [0, 1, 2, 3])
        swarm.run(cancel(tasks))
    row("a member trickles 8-byte chunks every 0.5 s on a new stream to every reducer, 30 rounds of 1 MiB",
        agree and rss[29] - rss[10] < 48,
        f"RSS {rss[0]:.0f} / {rss[10]:.0f} / {rss[29]:.0f} MiB at rounds 1 / 11 / 30 (4 peers in one process); "
        f"slowest round {slowest:.2f} s (bound {CFG.result_timeout:.0f} s)")
    # probe floods
    with LocalSwarm(2, config=CFG) as swarm:
        victim = swarm.nodes[0]
        gate = swarm.run(serve_probe(victim.p2p))
        attacker = swarm.run(start_outsider(swarm))

        async def probe_flood() -> None:
            async def one() -> None:
                try:
                    _, reader, writer = await attacker.call_binary_stream_handler(victim.p2p.peer_id, PROBE_PROTOCOL)
                    await write_frame(writer, pb.ProbeRequest(version=PROTOCOL_VERSION, upload_bytes=MAX_PROBE_BYTES,
                                                              download_bytes=MAX_PROBE_BYTES))
                    for _ in range(MAX_PROBE_BYTES // BLOCK):
                        writer.write(bytes(BLOCK))
                        await writer.drain()
                    while await asyncio.wait_for(reader.read(BLOCK), 30):
                        pass
                except Exception:
                    pass

            await asyncio.gather(*(one() for _ in range(48)))

        before = rss_mib()
        with PeakRss() as peak:
            flood = asyncio.run_coroutine_threadsafe(probe_flood(), swarm._loop.loop)
            up, _ = swarm.run(measure(swarm.nodes[1].p2p, victim.peer_id, nbytes=1 << 20))
            flood.result(120)
        swarm.run(attacker.shutdown())
    row("an outsider opens 48 probe streams announcing and sending 8 MiB each", peak.mib - before < 32 and up > 0,
        f"peak RSS +{peak.mib - before:.0f} MiB (384 MiB announced); {gate.refused} refused; a member's probe "
        f"still answered")
    # idle streams at a donor
    blob = bytes(range(256)) * 4096
    with LocalSwarm(2, config=CFG) as swarm:
        donor = swarm.nodes[0]
        server = StateServer(donor.p2p, "run", max_uploads=1, provider=lambda min_step: (7, blob, b"d" * 16))
        swarm.run(server.start())
        attacker = swarm.run(start_outsider(swarm))
        stop = asyncio.Event()
        idle = asyncio.run_coroutine_threadsafe(hold_streams(attacker, donor.peer_id, STATE_PROTOCOL, 20, stop),
                                                swarm._loop.loop)
        time.sleep(1.0)
        started = time.monotonic()
        try:
            got = swarm.run(download_state(swarm.nodes[1].p2p, [donor.peer_id], "run", min_step=1, max_bytes=len(blob),
                                           timeout=30, attempts=1))[1] == blob
        except Exception:
            got = False
        took = time.monotonic() - started
        swarm._loop.loop.call_soon_threadsafe(stop.set)
        idle.result(60)
        swarm.run(attacker.shutdown())
    row("20 idle state streams at a donor serving 1 download at a time", got,
        f"a member's 1 MB download done in {took:.2f} s, no 'busy' (only admitted requests take a slot)")
    # a leave mid-round
    errors = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())  # type: ignore[assignment]
    logging.getLogger().addHandler(handler)
    try:
        swarm = LocalSwarm(4, config=CFG).__enter__()
        try:
            codes = _codes(4, numel)
            for step in range(3):
                swarm.allreduce(codes, step=step)
            inflight = threading.Thread(target=_quietly, args=(swarm.allreduce, codes), kwargs=dict(step=3, delays={3: 30}))
            inflight.start()
            time.sleep(1.0)
        finally:
            swarm.__exit__(None, None, None)
        inflight.join(30)
    finally:
        logging.getLogger().removeHandler(handler)
    row("4 peers leave while a round is in flight (kept streams open everywhere)", not errors,
        f"{len(errors)} ERROR records, {sum('Traceback' in e or 'CancelledError' in e for e in errors)} tracebacks")
    return rows


def _quietly(call, *args, **kwargs) -> None:
    try:
        call(*args, **kwargs)
    except BaseException:
        pass


def table(report: dict) -> str:
    lines = ["| check | result |", "|---|---|"]
    for row in report.get("bad_voters", []):
        lines.append(f"| {row['method']}, bad voters: {row['bad']} | test acc {row['accuracy']:.1f}% "
                     f"(gap to honest {row['gap']:+.1f} points) |")
    for lr in report.get("lying_reducer", []):
        lines.append(f"| lying reducer: {lr['liar']} | caught in {lr['rounds_caught']} of {lr['rounds_lied']} lying rounds "
                     f"({100 * lr['rate']:.0f}%, predicted {100 * lr['predicted']:.0f}%), first catch at rounds "
                     f"{lr['first_catch']} of each seed; {lr['false_alarms']} false alarms; evidence checks: "
                     f"{lr['evidence_ok']} |")
    for row in report.get("attacks", []):
        lines.append(f"| {row['attack']} | {'held' if row['held'] else '**BROKEN**'}: {row['outcome']} |")
    for row in report.get("faults", []):
        lines.append(f"| {row['fault']} | {row['survivors']} survivors, updates identical: {row['identical']}, "
                     f"round {row['round_s']:.1f} s (bound {row['bound_s']:.0f} s) |")
    adm = report.get("admission")
    if adm:
        lines.append(f"| peer without the run secret | counted: {adm['outsider_counted']}, refusals logged: "
                     f"{adm['outsider_refusals_logged']}, members identical: {adm['members_identical']} |")
        lines.append(f"| {adm['flood_streams']} junk streams with 900 MiB frame headers during a round | round "
                     f"{adm['flood_round_s']:.2f} s vs {adm['clean_round_s']:.2f} s clean |")
    for row in report.get("process_faults", []):
        lines.append(f"| processes: {row['fault']} | {row['survivors']}/{row['expected']} survivors at step "
                     f"{row['steps']}, parameters identical: {row['identical']}, step median {row['median_step_s']:.2f} s"
                     f" / max {row['max_step_s']:.1f} s (bound {row['bound_s']:.0f} s), repairs {row['repairs']}, "
                     f"probation re-adds {row.get('probation_readds', 0)} |")
    soak = report.get("soak")
    if soak:
        lines.append(f"| soak | {soak['rounds']} rounds in {soak['seconds']:.0f} s, faults {soak['faults']}, "
                     f"repairs {soak['repairs']}, unrepaired {soak['unrepaired']}, identical at end: "
                     f"{soak['identical_at_end']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    run(argv)


SECTIONS = ("bad_voters", "lying_reducer", "faults", "admission", "attacks", "soak", "process_faults")


def run(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--soak-rounds", type=int, default=300)
    parser.add_argument("--soak-peers", type=int, default=4)
    parser.add_argument("--soak-max-group", type=int, default=0,
                        help="soak with a two-level vote in groups of at most this many (0: one flat group)")
    parser.add_argument("--soak-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=300, help="training steps of the bad-voter runs")
    parser.add_argument("--process-steps", type=int, default=150, help="steps of each process-fault scenario")
    parser.add_argument("--skip-process-faults", action="store_true", help="leave out the process scenarios (~8 min)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    parser.add_argument("--out", type=Path, default=Path("runs/reliability.json"))
    args = parser.parse_args(argv)
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.skip_process_faults and "process_faults" in only:
        only.remove("process_faults")
    check_report_path("--out", args.out)  # now, not after an hour of runs
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    runners = {"bad_voters": lambda: bad_voters(args.steps), "lying_reducer": lying_reducers, "faults": faults,
               "admission": admission_and_flood, "attacks": lambda: round_attacks(tempfile.mkdtemp()),
               "soak": lambda: asdict(run_soak(args.soak_rounds, args.soak_peers, seed=args.soak_seed,
                                               max_group=args.soak_max_group)),
               "process_faults": lambda: run_process_faults(args.out.parent / "process_faults",
                                                            steps=args.process_steps)}
    report = {}
    for name in SECTIONS:
        if name not in only:
            continue
        started = time.monotonic()
        report[name] = runners[name]()
        print(f"{name}: done in {time.monotonic() - started:.0f} s", flush=True)
    print("\n" + table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if (aside := keep_previous_report(args.out)) is not None:
        print(f"the previous report is kept as {aside}")
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nJSON: {args.out}")
    return report


if __name__ == "__main__":
    main()
