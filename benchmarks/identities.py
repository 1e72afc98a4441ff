"""Identities an attacker controls against test accuracy, and which count it reaches in each kind of run.

Issue 44 ("identities are free"). Two parts, digits, 1-bit majority votes, inverting voters (each sends
the negation of its honest vote, which is the worst a single 1-bit voter can do to a majority):

1. The sweep, in process (``sim.inprocess.run_method``, no network, the same method settings as
   ``lioncub-reliability``'s bad voters: momentum averaged every 10 steps): 5 honest voters plus k
   inverting identities, k in 0 1 2 3 4 5 6 8, several seeds; test accuracy and loss at a fixed step
   count (median and min-max over seeds). Honest voter i draws from shard i of 5 with the same
   generator for every k, so the runs of one seed differ only by the bad votes; the inverting voters
   draw from the same shards (they compute an honest direction on real data and send its negation).
2. The count an attacker reaches, on real swarms on 127.0.0.1 (one ``Swarm`` per identity, each with its
   own DHT process and libp2p daemon, in threads; digits MLP 64 wide, lr 1e-3, as tests/test_swarm.py):
   3 honest peers and an attacker that starts 3 identities, whose peers invert the packed sign bits they
   submit (``Swarm.submit``). Open run: all 3 are admitted. Secret run: the attacker knows the run secret
   (as any member does): all 3. Invited run: the organizer gave the attacker one ticket; its second
   identity reuses that ticket (the library stops it at start; a modified client that skips that check
   is then asked about directly: the live leader refuses it), the third has none (refused by the leader).
   Plus an all-honest run for comparison.

    python benchmarks/identities.py            # about 5 minutes on 2 cores (4.5 measured, machine shared)
    python benchmarks/identities.py --quick    # ~20 s: 1 seed, k in 0 3 6, 100 steps; one invited swarm of 20 steps

Prints a markdown table per part and writes ``runs/identities.json``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")  # its DHT processes too: no "checking that identity" lines

from lioncub_p2p import LionCub  # noqa: E402
from lioncub_p2p.momentum import MomentumSchedule  # noqa: E402
from lioncub_p2p.sim.compare_tasks import LegacyTask  # noqa: E402
from lioncub_p2p.sim.inprocess import Method, run_method  # noqa: E402
from lioncub_p2p.tasks.digits import digits_task  # noqa: E402

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
SECRET = "members-know-this"


# ---------------------------------------------------------------------------------------------
# 1. the sweep, in process


class HonestShards(LegacyTask):
    """Voter i draws from shard i mod ``honest`` of ``honest``: honest voters see the same data whatever
    the number of bad identities added after them."""

    def __init__(self, task, honest: int):
        super().__init__(task)
        self.honest = honest

    def batches(self, workers, batch, gens):
        return [lambda i=i: self.task.sample(i % self.honest, self.honest, batch, gens[i]) for i in range(workers)]


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def sweep(ks: list[int], seeds: list[int], steps: int, honest: int = 5) -> list[dict]:
    task = HonestShards(digits_task(0), honest)
    method = Method("1-bit majority", "sign", "majority", MomentumSchedule(every=10))  # as reliability.bad_voters
    rows = []
    for k in ks:
        started = time.monotonic()
        outs = [run_method(method, task, workers=honest + k, steps=steps, seed=seed,
                           byzantine={honest + j: "invert" for j in range(k)}) for seed in seeds]
        rows.append(dict(k=k, voters=honest + k, share=k / (honest + k), steps=steps, seeds=list(seeds),
                         accuracy=_spread([o.test_accuracy for o in outs]), loss=_spread([o.test_loss for o in outs]),
                         replicas_identical=all(o.replicas_identical for o in outs)))
        r = rows[-1]
        print(f"  k={k}: accuracy median {r['accuracy']['median']:.1f}% ({r['accuracy']['min']:.1f}-"
              f"{r['accuracy']['max']:.1f}), loss {r['loss']['median']:.3f} ({time.monotonic() - started:.0f} s)",
              flush=True)
    return rows


def sweep_table(rows: list[dict], honest: int = 5) -> str:
    seeds, steps = len(rows[0]["seeds"]), rows[0]["steps"]
    lines = [f"| inverting identities k (+ {honest} honest) | share of the votes | test accuracy at step {steps}, "
             f"median (min-max of {seeds} seeds) | test loss, median (min-max) |", "|---|---|---|---|"]
    for r in rows:
        a, lo = r["accuracy"], r["loss"]
        side = "more than half" if 2 * r["k"] > r["voters"] else "half: ties broken by a shared random bit" \
            if 2 * r["k"] == r["voters"] else "fewer than half"
        lines.append(f"| {r['k']} | {r['k']}/{r['voters']}, {side} | {a['median']:.1f}% ({a['min']:.1f}-{a['max']:.1f}) "
                     f"| {lo['median']:.3f} ({lo['min']:.3f}-{lo['max']:.3f}) |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 2. which k an attacker reaches, on real swarms


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:400] if text else ''}"


def _short(line: str, names: dict[str, str], run_id: str) -> str:
    """An error line for a table: peer ids by name, the run by "the run", the advice after it cut."""
    for peer_id, name in names.items():
        line = line.replace(peer_id, name)
    line = line.replace(f"run {run_id}", "the run")
    for hint in (": pass --", " (they run", ": ask the run", ", then pass", ": ask its organizer"):
        line = line.split(hint)[0]
    return line


def _inverting(swarm) -> None:
    """The attacker's peer: every vote it submits is the bitwise negation of its honest packed signs."""
    honest_submit = swarm.submit

    def submit(upload: torch.Tensor, *, step: int):
        return honest_submit(~upload, step=step)

    swarm.submit = submit  # ``aggregate`` (synchronous rounds) calls ``self.submit``


def _reused_ticket_probe(run_id: str, maddrs: list[str], leader: str, key_path: str, ticket, authority: str) -> dict:
    """A modified client that skips the library's own check: the attacker's second identity shows the
    ticket of its first to the live leader over a real admission exchange."""
    from hivemind.p2p import P2P

    from lioncub_p2p.allreduce.admission import Admission
    from lioncub_p2p.swarm import admit
    from lioncub_p2p.swarm.tickets import TicketBook

    async def ask() -> dict:
        p2p = await P2P.create(initial_peers=maddrs, host_maddrs=LOOPBACK, identity_path=key_path,
                               nat_port_map=False, auto_nat=False)
        try:
            verdict = await admit.ask_admission(p2p, leader, Admission(run_id, invitations=TicketBook(
                run_id, authority, own=ticket)))
            return {"admitted": bool(verdict.admitted), "reason": str(verdict.reason)[:240]}
        finally:
            await p2p.shutdown()

    try:
        return asyncio.run(asyncio.wait_for(ask(), 30))
    except Exception as e:
        return {"admitted": False, "reason": f"exchange failed ({_first_line(e)})"}


def swarm_run(kind: str, *, steps: int, workdir: Path, honest: int = 3, attacker: int = 3, hidden: int = 64,
              budget_s: float = 150.0) -> dict:
    """One run of ``kind`` (none, open, secret, invited): ``honest`` peers train, the attacker starts
    ``attacker`` inverting identities; returns who was admitted and what the honest peers' models score."""
    from lioncub_p2p.identity import Identity
    from lioncub_p2p.swarm import Swarm, SwarmConfig, snapshot
    from lioncub_p2p.swarm.tickets import issue
    from lioncub_p2p.testing import SWARM_ROUNDS

    started = time.monotonic()
    deadline = started + budget_s
    run_id = f"ids-{kind}-{os.getpid()}-{int(time.time() * 1000) % 10**6}"
    folder = workdir / run_id
    folder.mkdir(parents=True)
    task = digits_task(0, hidden=hidden)
    attacker = 0 if kind == "none" else attacker
    keys = {}

    def key(name: str) -> str:
        keys[name] = Identity.load_or_create(folder / f"{name}.key")
        return str(keys[name].path)

    common = dict(host_maddrs=LOOPBACK, allreduce=SWARM_ROUNDS, join_timeout=30.0)
    honest_cfgs: list[dict] = []
    if kind == "invited":
        authority = Identity.load_or_create(folder / "authority.key")
        for i in range(honest):
            path = key(f"h{i}")
            honest_cfgs.append(dict(identity_path=path, ticket=issue(authority, run_id, keys[f"h{i}"].peer_id, days=1,
                                                                      max_weight=1).text()))
        key("a0")
        own = issue(authority, run_id, keys["a0"].peer_id, days=1, max_weight=1)
        plans = [("A1, its own ticket", dict(identity_path=str(keys["a0"].path), ticket=own.text()))]
        for j in range(1, attacker):
            path = key(f"a{j}")
            plans.append((f"A{j + 1}, A1's ticket", dict(identity_path=path, ticket=own.text())) if j % 2 == 1 else
                         (f"A{j + 1}, no ticket", dict(identity_path=path)))
        expected_bad = min(attacker, 1)
    else:
        secret = dict(run_secret=SECRET) if kind == "secret" else {}
        honest_cfgs = [dict(secret) for _ in range(honest)]
        plans = [("knows the secret" if secret else "fresh key", dict(secret)) for _ in range(attacker)]
        expected_bad = attacker
    expected = honest + expected_bad  # every thread waits for this many members before its first step

    peers: list[dict] = []  # per identity: role, label, swarm, outcome
    results: dict[int, dict] = {}
    threads: list[threading.Thread] = []
    group_sizes: list[int] = []
    counted: list[int] = []  # per round the founder took part in: the fewest votes counted in a part

    def train(index: int) -> None:
        peer = peers[index]
        swarm = peer["swarm"]
        try:
            model = task.make_model(seed=index)
            opt = LionCub(model.named_parameters(), lr=1e-3, weight_decay=0.1, aggregator=swarm)
            if peer["role"] == "attacker":
                _inverting(swarm)
            swarm.final_step = steps
            swarm.join(opt, wait_peers=expected, wait_timeout=max(5.0, min(60.0, deadline - time.monotonic())))
            x, y = task.shard(peer["shard"], honest)
            gen = torch.Generator().manual_seed(index)
            while opt.step_count < steps and time.monotonic() < deadline:
                idx = torch.randint(0, len(x), (32,), generator=gen)
                nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
                opt.zero_grad()
                if index == 0 and opt.step_count == steps // 2:
                    group_sizes.append(len(swarm.history.latest.members))
                if index == 0 and swarm.last_report is not None:  # votes counted in this round's parts
                    counts = [len(p.counted) for p in swarm.last_report.parts if p.counted]
                    counted.append(min(counts) if counts else 0)
                time.sleep(0.02)
            swarm.settle_final_state(min(20.0, max(1.0, deadline - time.monotonic())))
            loss, accuracy = task.evaluate(model)
            results[index] = dict(step=opt.step_count, loss=loss, accuracy=accuracy,
                                  digest=snapshot.params_digest(opt).hex()[:16])
        except Exception as e:  # recorded: a refusal at join, a timeout
            results[index] = dict(error=_first_line(e), refused="AdmissionRefused" in type(e).__name__)

    def start(index: int) -> None:
        thread = threading.Thread(target=train, args=(index,), name=f"peer-{index}", daemon=True)
        threads.append(thread)
        thread.start()

    probe = None
    try:
        first = Swarm(SwarmConfig(run_id, **common, **honest_cfgs[0]))
        maddrs = first.visible_maddrs()
        peers.append(dict(role="honest", label="founder", swarm=first, shard=0))
        start(0)
        while first.history.latest is None and time.monotonic() < deadline and 0 not in results:
            time.sleep(0.1)  # the run exists (its group and manifest): what an attacker meets
        for i, cfg in enumerate(honest_cfgs[1:], start=1):
            peers.append(dict(role="honest", label="honest", shard=i,
                              swarm=Swarm(SwarmConfig(run_id, initial_peers=maddrs, **common, **cfg))))
            start(len(peers) - 1)
            time.sleep(0.3)
        for j, (label, cfg) in enumerate(plans):
            entry = dict(role="attacker", label=label, shard=j % honest, swarm=None)
            try:
                entry["swarm"] = Swarm(SwarmConfig(run_id, initial_peers=maddrs, **common, **cfg))
            except Exception as e:  # refused or stopped when it started
                entry["refused_at_start"] = _first_line(e)
            peers.append(entry)
            if entry["swarm"] is not None:
                start(len(peers) - 1)
                time.sleep(0.3)
        if kind == "invited" and attacker > 1:
            probe = _reused_ticket_probe(run_id, maddrs, first.peer_id, str(keys["a1"].path), own,
                                         authority.peer_id)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    finally:
        for peer in peers:
            if peer.get("swarm") is not None:
                try:
                    peer["swarm"].shutdown()
                except Exception as e:
                    logging.getLogger("identities").warning("shutdown: %s", e)
    names = {identity.peer_id: f"{name[0].upper()}{int(name[1:]) + 1}" for name, identity in keys.items()}
    for peer in peers:
        if peer.get("swarm") is not None and getattr(peer["swarm"], "peer_id", None):
            names.setdefault(peer["swarm"].peer_id, f"{peer['role']} {len(names)}")
    for peer in peers:
        if "refused_at_start" in peer:
            peer["refused_at_start"] = _short(peer["refused_at_start"], names, run_id)
    for index, got in results.items():
        if "error" in got:
            got["error"] = _short(got["error"], names, run_id)
    if probe:
        probe["reason"] = _short(probe["reason"], names, run_id)
    out_peers = []
    for index, peer in enumerate(peers):
        row = dict(role=peer["role"], label=peer["label"])
        if "refused_at_start" in peer:
            row.update(admitted=False, outcome=peer["refused_at_start"])
        else:
            got = results.get(index, dict(error="did not finish in the run's time budget"))
            row.update(got, admitted="error" not in got and got.get("step") == steps)
            if "error" in got:
                row["outcome"] = got["error"]
        out_peers.append(row)
    honest_rows = [r for r in out_peers if r["role"] == "honest" and "accuracy" in r]
    bad_admitted = sum(r["admitted"] for r in out_peers if r["role"] == "attacker")
    report = dict(kind=kind, steps=steps, honest=honest, attacker_identities=attacker, expected_admitted=expected_bad,
                  admitted=bad_admitted, voters=honest + bad_admitted, group_at_half=group_sizes[:1],
                  counted_median=statistics.median(counted) if counted else None, counted_max=max(counted, default=None),
                  honest_finished=len(honest_rows),
                  accuracy=[r["accuracy"] for r in honest_rows], loss=[r["loss"] for r in honest_rows],
                  identical=len({r["digest"] for r in honest_rows}) == 1 and len(honest_rows) == honest,
                  peers=out_peers, reused_ticket_probe=probe, seconds=time.monotonic() - started)
    print(f"  {kind}: attacker admitted {bad_admitted} of {attacker}, honest accuracy "
          f"{', '.join(f'{a:.1f}%' for a in report['accuracy'])} ({report['seconds']:.0f} s)", flush=True)
    for row in out_peers:
        if row.get("outcome"):
            print(f"    {row['role']} ({row['label']}): {row['outcome']}", flush=True)
    if probe:
        print(f"    modified client showing the reused ticket to the leader: admitted={probe['admitted']} "
              f"({probe['reason']})", flush=True)
    return report


KIND_NAMES = {"none": "all honest (no attacker)", "open": "open run", "secret": "secret run (attacker knows the secret)",
              "invited": "invited run (attacker holds 1 ticket)"}


def swarm_table(rows: list[dict]) -> str:
    steps = rows[0]["steps"]
    lines = [f"| run | attacker identities started | admitted (voting) | group members at step {steps // 2} | votes "
             f"counted per part (median / most over rounds) | honest peers' test accuracy at "
             f"step {steps} | test loss | honest peers identical | what happened to the others |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{statistics.median(r['accuracy']):.1f}%" if r["accuracy"] else "-"
        loss = f"{statistics.median(r['loss']):.3f}" if r["loss"] else "-"
        if r["accuracy"] and max(r["accuracy"]) - min(r["accuracy"]) > 0.05:
            acc += f" ({min(r['accuracy']):.1f}-{max(r['accuracy']):.1f})"
        others = [f"{p['label']}: {p['outcome']}" for p in r["peers"] if p["role"] == "attacker" and not p["admitted"]]
        if r.get("reused_ticket_probe"):
            p = r["reused_ticket_probe"]
            others.append(f"A2 as a modified client skipping that check, asking the leader: "
                          f"{'ADMITTED' if p['admitted'] else 'refused'} ({p['reason']})")
        lines.append(f"| {KIND_NAMES[r['kind']]} | {r['attacker_identities']} | {r['admitted']} | "
                     f"{r['group_at_half'][0] if r['group_at_half'] else '?'} ({r['honest']} honest + {r['admitted']}) | "
                     f"{format(r['counted_median'], 'g') if r['counted_median'] is not None else '-'} / {r['counted_max']} | {acc} | {loss} | {'yes' if r['identical'] else 'no'} | "
                     f"{'; '.join(others).replace('|', '/') or '-'} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute): 1 seed, k in 0 3 6, "
                                                              "100 steps; one invited swarm of 20 steps")
    parser.add_argument("--steps", type=int, default=None, help="steps of the in-process sweep [200]")
    parser.add_argument("--seeds", type=int, default=None, help="seeds of the sweep [5]")
    parser.add_argument("--swarm-steps", type=int, default=None, help="steps of each swarm run [100]")
    parser.add_argument("--kinds", default=None, help="swarm runs, comma-separated KIND[:IDENTITIES] of none, open, "
                                                      "secret, invited (3 identities unless given) "
                                                      "[none,open,secret,invited,open:4]")
    parser.add_argument("--skip-swarms", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("runs/identities.json"))
    args = parser.parse_args(argv)
    quick = args.quick
    steps = args.steps or (100 if quick else 200)
    seeds = list(range(args.seeds or (1 if quick else 5)))
    ks = [0, 3, 6] if quick else [0, 1, 2, 3, 4, 5, 6, 8]
    swarm_steps = args.swarm_steps or (20 if quick else 100)
    kinds = (args.kinds or ("invited" if quick else "none,open,secret,invited,open:4")).split(",")
    runs = []
    for spec in kinds:
        kind, _, count = spec.partition(":")
        if kind not in KIND_NAMES or (count and not count.isdigit()):
            parser.error(f"--kinds {spec!r}: expected one of {', '.join(KIND_NAMES)}, optionally :IDENTITIES")
        runs.append((kind, int(count) if count else 3))
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(1)
    began = time.monotonic()
    report: dict = dict(config=dict(quick=quick, steps=steps, seeds=seeds, ks=ks, swarm_steps=swarm_steps, kinds=kinds,
                                    cores=os.cpu_count()))
    print(f"1. in process: 5 honest voters + k inverting identities, {steps} steps, seeds {seeds}", flush=True)
    report["sweep"] = sweep(ks, seeds, steps)
    if not args.skip_swarms:
        print(f"2. real swarms on 127.0.0.1: 3 honest peers + an attacker starting identities, {swarm_steps} steps",
              flush=True)
        with tempfile.TemporaryDirectory(prefix="lioncub-identities-") as workdir:
            report["swarms"] = [swarm_run(kind, steps=swarm_steps, workdir=Path(workdir), attacker=count)
                                for kind, count in runs]
    report["seconds"] = time.monotonic() - began
    print(f"\nIn process (digits, 1-bit majority, momentum averaged every 10 steps, inverting voters):\n")
    print(sweep_table(report["sweep"]))
    if report.get("swarms"):
        print(f"\nReal swarms on 127.0.0.1 (digits MLP 64 wide, lr 1e-3, inverting identities):\n")
        print(swarm_table(report["swarms"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\n{report['seconds']:.0f} s; JSON: {args.out}")
    return report


if __name__ == "__main__":
    main()
