"""Faults of whole processes: real trainers (``lioncub-train``) on their own links, one fault each.

Each scenario is a short simulator run (``Simulation``, method ``lioncub``) with a fixed step count,
so every survivor ends at the same step and their final parameters can be compared bit for bit.
Deaths at a precise protocol point come from failpoints (``lioncub_p2p.failpoints``): the victim
SIGKILLs itself there. What a row says:

- survivors: peers that were meant to live and exited cleanly (exit 0) at the last step;
- identical: their final parameters are bitwise equal;
- max step: the slowest optimizer step any survivor took (vote round, recovery and, on momentum
  steps, the averaging round), against the bound its timeouts allow;
- probation re-adds: members the leader took back on probation after dropping them for missed votes.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..trainer_rounds import allreduce_config
from .launcher import Simulation
from .links import LinkProfile

UPLOAD_TIMEOUT, RESULT_TIMEOUT = 3.0, 6.0
RECOVERY_TIMEOUT = allreduce_config(UPLOAD_TIMEOUT, RESULT_TIMEOUT).recovery_timeout  # as lioncub-train runs


@dataclass
class Scenario:
    label: str
    peers: list[dict]  # LinkProfile fields per peer
    steps_factor: float = 1.0  # newcomers need a longer run (a process starts in seconds); a 1 Mbit/s peer a shorter one
    max_group: int = 0  # a two-level vote in groups of at most this many (0: one flat group)

    def victims(self) -> set[int]:
        """Peers this scenario kills on purpose (they are not expected to finish)."""
        return {i for i, p in enumerate(self.peers) if p.get("failpoint")}


FAST = {"mbit": 100}
SCENARIOS = [
    Scenario("SIGKILL mid-upload (voter)", [FAST, FAST, {**FAST, "failpoint": "upload@20"}, FAST]),
    Scenario("SIGKILL during reduction (reducer, nobody answered)", [FAST, FAST, {**FAST, "failpoint": "reduce@20"}, FAST]),
    Scenario("SIGKILL mid-answer (reducer, some voters answered)", [FAST, FAST, {**FAST, "failpoint": "result@20"}, FAST]),
    Scenario("SIGKILL in momentum averaging", [FAST, FAST, {**FAST, "failpoint": "momentum@20"}, FAST]),
    # the donor has the fastest link, so the newcomer asks it first
    Scenario("SIGKILL of the donor mid-transfer", [FAST, {"mbit": 200, "failpoint": "serve"}, FAST, FAST,
                                                   {**FAST, "join_at": 5}], steps_factor=2.0),
    Scenario("SIGKILL of the newcomer mid-download", [FAST, FAST, FAST, {**FAST, "join_at": 5, "failpoint": "download"}],
             steps_factor=2.0),
    Scenario("SIGSTOP stall of 4 s", [FAST, FAST, {**FAST, "stall_at": 20, "stall_s": 4}, FAST]),
    Scenario("link cut for 4 s mid-transfer", [FAST, FAST, {**FAST, "cut_at": 20, "cut_s": 4}, FAST]),
    Scenario("one 1 Mbit/s link among 100 Mbit/s", [FAST, FAST, FAST, {"mbit": 1}], steps_factor=0.4),
    # three groups of 2 (two-level needs 3 groups): peer 2 reduces a part of its group and combines a slice of
    # that part for the other groups; its group's other member has nobody else to ask for a part it missed
    Scenario("two-level: SIGKILL during reduction (before combining)",
             [FAST, FAST, {**FAST, "failpoint": "reduce@20"}, FAST, FAST, FAST], max_group=2),
    Scenario("two-level: SIGKILL mid-combining (some groups have its slice)",
             [FAST, FAST, {**FAST, "failpoint": "combine@20"}, FAST, FAST, FAST], max_group=2),
    Scenario("two-level: SIGKILL after combining, mid-answer to its group",
             [FAST, FAST, {**FAST, "failpoint": "result@20"}, FAST, FAST, FAST], max_group=2),
    Scenario("two-level: SIGSTOP stall of 4 s", [FAST, FAST, {**FAST, "stall_at": 20, "stall_s": 4}, FAST, FAST, FAST],
             max_group=2),
    Scenario("two-level: link cut for 4 s", [FAST, FAST, {**FAST, "cut_at": 20, "cut_s": 4}, FAST, FAST, FAST],
             max_group=2),
    # its training thread sleeps while its event loop goes on announcing it (a hung data loader): its record
    # never expires, so only missed votes get it dropped; in another group than the leader's, its group-mate
    # reports them (lead.reported_by_most)
    Scenario("training thread hangs 12 s (its record lives on)",
             [FAST, FAST, {**FAST, "hang_at": 20, "hang_s": 12}, FAST]),
    Scenario("two-level: training thread hangs 12 s (its record lives on)",
             [FAST, FAST, {**FAST, "hang_at": 20, "hang_s": 12}, FAST, FAST, FAST], max_group=2),
    Scenario("two-level: a newcomer joins (the groups reshuffle)", [FAST, FAST, FAST, FAST, FAST, FAST,
                                                                   {**FAST, "join_at": 5}], steps_factor=2.0, max_group=2),
]


def run_scenario(scenario: Scenario, workdir: Path, *, steps: int, hidden: int, shaping: str = "auto",
                 method: str = "lioncub") -> dict:
    profiles = [LinkProfile.from_dict(p) for p in scenario.peers]
    sim = Simulation(profiles, shaping=shaping, workdir=workdir, hidden=hidden, batch=32, steps=steps, seconds=600,
                     lr=3e-4, eval_every=0, timeouts=(UPLOAD_TIMEOUT, RESULT_TIMEOUT), max_group=scenario.max_group)
    try:
        result = sim.run(method)
    finally:
        sim.close()
    expected = [i for i in range(len(profiles)) if i not in scenario.victims()]
    survivors = [i for i in expected if result.exit_codes[i] == 0 and result.final_steps[i] == steps]
    step_times, logs = [], [workdir / method / f"peer{i}.log" for i in range(len(profiles))]
    readds = sum(log.read_text(errors="replace").count("rejoins without a part, on probation")
                 for log in logs if log.exists())
    for i in survivors:
        rows = [json.loads(line) for line in (workdir / method / f"peer{i}.jsonl").read_text().splitlines()]
        step_times += [r["step_s"] for r in rows[1:]]  # the first step also opens every connection
    return dict(fault=scenario.label, shaping=sim.shaping, peers=len(profiles), survivors=len(survivors),
                expected=len(expected), victims_died=all(result.exit_codes[i] not in (0, None)
                                                         for i in scenario.victims()),
                identical=result.identical_final_params is True and len(survivors) == len(expected),
                steps=steps, max_step_s=max(step_times, default=float("nan")),
                median_step_s=statistics.median(step_times) if step_times else float("nan"),
                bound_s=2 * RESULT_TIMEOUT + RECOVERY_TIMEOUT, repairs=result.divergence_events,
                probation_readds=readds,
                exit_codes=result.exit_codes)


def run_process_faults(workdir: Path, *, steps: int = 150, hidden: int = 512,
                       only: list[str] | None = None) -> list[dict]:
    rows = []
    for k, scenario in enumerate(SCENARIOS):
        if only and not any(word in scenario.label for word in only):
            continue
        rows.append(run_scenario(scenario, workdir / f"scenario{k}", steps=int(steps * scenario.steps_factor),
                                 hidden=hidden))
    return rows
