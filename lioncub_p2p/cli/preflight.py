"""lioncub-train --preflight: can this machine take part, and how fast will its rounds be?

Checks, in order, each with a one-line verdict: the coordinators answer (the DHT starts and finds
the run's records); the run admits this peer (a private run's leader refuses a peer without its
secret, an open run one with a secret) and this peer's flags agree with the run's manifest: a
failed check with a non-zero exit; whether peers can dial this machine (the coordinators dial it
back, the same check lioncub-train makes before joining: dialable, or it will join in client mode),
and the exact flags to change; the upload and download bandwidth to a member of the run's group (a
timed 4 MiB probe each way, only to members: the probe carries the run token; a refused token is a
failed check, a member that is busy or closes the probe unanswered a warning and the next member); the compute time of one step of the run's task here; and the role this link puts the
peer in at the group's current pace (voter, follower, or behind: ``swarm/follow.py``). Exit code 0:
ready.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..swarm import AdmissionRefused, Manifest, SettingsMismatch, Swarm, SwarmConfig, SwarmError
from ..swarm.membership import GroupRecord, PeerRecord
from ..swarm.config import LISTEN_ALL
from ..swarm.follow import link_role
from ..swarm.probe import ProbeBusy, ProbeDenied, measure
from ..swarm.reachability import ListenPlan
from .addresses import PUBLIC_PORT_ADVICE, dialable_from_outside, scope

PACE_WINDOW_S = 10.0  # the group's pace is read from peer records this far apart
FAIL_COORDINATORS, FAIL_EMPTY_RUN, FAIL_ADMISSION, FAIL_PROBE, FAIL_SETTINGS = 2, 3, 4, 5, 6


def reachability_verdicts(config: SwarmConfig, visible: list[str], plan: ListenPlan | None) -> list[tuple[str, str]]:
    """("OK" or "WARN", line) pairs saying whether others can dial this peer, and which flag to change.

    ``config`` is the swarm's (client mode resolved); ``plan`` what the dial-back found (``Swarm.listen_plan``)."""
    found = plan.reachability if plan is not None else None
    if found is not None and found.answered:
        if config.client_mode:
            return [("OK", f"the coordinators cannot dial you back at {found.observed_ip}:{_port(config)} (behind "
                           f"NAT or a firewall): you will join in client mode (you vote and receive every result, "
                           f"you reduce nothing and serve no state); to reduce as well, forward a port (e.g. 31337) "
                           f"on your router to this machine and pass --host-maddrs /ip4/0.0.0.0/tcp/31337 "
                           f"--announce-maddrs /ip4/YOUR_PUBLIC_IP/tcp/31337")]
        lines = [("OK", f"dialable: the coordinators dialed you back at {found.observed_ip}:{_port(config)}"
                        + (f" (announcing {' '.join(config.announce_maddrs)})" if config.announce_maddrs else ""))]
        if visible and all(scope(m) == "loopback" for m in visible):
            lines.append(_loopback_only(config))
        return lines
    return [reachability_verdict(config, visible)]


def _port(config: SwarmConfig) -> str:
    tcp = [m.split("/")[4] for m in config.host_maddrs if len(m.split("/")) == 5 and m.split("/")[3] == "tcp"]
    return tcp[0] if tcp else "?"


def _loopback_only(config: SwarmConfig) -> tuple[str, str]:
    return "WARN", (f"you listen on loopback only ({' '.join(config.host_maddrs)}): no other machine can dial you; "
                    f"listen on every interface with --host-maddrs {' '.join(LISTEN_ALL)} (the default), then "
                    f"{PUBLIC_PORT_ADVICE}")


def reachability_verdict(config: SwarmConfig, visible: list[str]) -> tuple[str, str]:
    """("OK" or "WARN", the line saying whether others can dial this peer and which flag to change),
    from its addresses alone (no dial-back answered: a founder, or coordinators of an older version)."""
    if config.client_mode:
        return "OK", "client mode: you dial out only; you vote and receive results, reduce nothing"
    if dialable_from_outside(visible):
        public = [m for m in visible if scope(m) == "public"]
        return "OK", f"reachable: peers can dial you at {public[0]}" + (f" (+{len(public) - 1} more)" if public[1:] else "")
    if visible and all(scope(m) == "loopback" for m in visible):
        return _loopback_only(config)
    return "WARN", (f"peers on other networks probably cannot dial you (private addresses only: "
                    f"{', '.join(visible) or 'none'}): {PUBLIC_PORT_ADVICE}")


def probe_targets(group: GroupRecord | None, records: dict[str, PeerRecord], me: str) -> list[str]:
    """Whom to probe: reducing members of the group that admitted this peer whose records (if any) say
    they are synced. Nobody else: a probe carries the run token, and anyone can publish a peer record."""
    if group is None:
        return []
    return [m.peer_id for m in group.members
            if m.reduces and m.peer_id != me and (m.peer_id not in records or records[m.peer_id].synced)]


def group_pace(before: dict[str, PeerRecord], after: dict[str, PeerRecord], seconds: float) -> float | None:
    """Seconds per group step from the furthest peer's step in two reads of the records, or None
    when nobody moved (nobody trains yet, or too short a window)."""
    moved = max((r.step for r in after.values()), default=0) - max((r.step for r in before.values()), default=0)
    return seconds / moved if moved > 0 else None


def preflight(config: SwarmConfig, task_for: Callable[[Manifest], tuple]) -> int:
    """Print the checks; returns a process exit code (0: ready). ``task_for(run manifest)`` gives
    (settings, task, batches_for) of the task this peer would train."""
    print(f"preflight for run {config.run_id!r}", flush=True)
    try:
        swarm = Swarm(config)
    except AdmissionRefused as e:
        print(f"  [FAIL] admission: {e}", flush=True)
        return FAIL_ADMISSION
    except SettingsMismatch as e:
        print(f"  [FAIL] settings: {e}", flush=True)
        return FAIL_SETTINGS
    except SwarmError as e:
        print(f"  [FAIL] coordinators: {e}", flush=True)
        return FAIL_COORDINATORS
    try:
        records = swarm.loop.run(swarm.directory.peers(), timeout=30)
        first_read = time.monotonic()
        group = swarm.history.latest  # the group that admitted this peer (in a private run: proved the key)
        if not config.initial_peers:
            print("  [WARN] no --initial-peers: this machine would start a run of its own")
        elif not records and group is None and swarm.run_manifest is None:
            print(f"  [FAIL] coordinators answer, but nobody announces run {config.run_id!r}: no manifest, nobody "
                  f"training (is --run-id right? To start a run of your own, leave out --preflight)")
            return FAIL_EMPTY_RUN
        elif not records and group is None:  # its coordinators announce it: the first volunteer founds its group
            print(f"  [ OK ] coordinators announce run {config.run_id!r} and nobody trains in it yet: this peer "
                  f"would found its group and train once others join")
        else:
            steps = max((r.step for r in records.values()), default=0)
            print(f"  [ OK ] coordinators answer: {len(records)} peers online, global step {steps}")
        if group is not None:
            print(f"  [ OK ] admission: the run's group (epoch {group.epoch}, {len(group.members)} members) "
                  f"admits this peer{' (run secret checked)' if config.run_secret else ''}")
        visible = [str(m) for m in swarm.config.announce_maddrs] or swarm.visible_maddrs()
        for verdict, line in reachability_verdicts(swarm.config, visible, swarm.listen_plan):
            print(f"  [{verdict:^4}] {line}", flush=True)
        up = down = None
        refusals = []
        donors = probe_targets(group, records, swarm.peer_id)
        for pid in donors[:3]:
            try:
                up, down = swarm.loop.run(measure(swarm.p2p, pid, token=swarm.admission.token(swarm.peer_id)),
                                          timeout=120)
                print(f"  [ OK ] bandwidth to {pid[:12]}…: upload {up:.1f} Mbit/s, download {down:.1f} Mbit/s")
                break
            except ProbeBusy as e:
                print(f"  [WARN] {e}")
            except ProbeDenied:
                refusals.append(f"{pid[:12]}…")
            except Exception as e:
                print(f"  [WARN] probe to {pid[:12]}… failed: {type(e).__name__}: {e}")
        if refusals and up is None:
            print(f"  [FAIL] the run's members refused the bandwidth probe: {', '.join(refusals)}: they admit only "
                  f"holders of the run's secret (check --run-secret) or allow-listed peer ids", flush=True)
            return FAIL_PROBE
        settings, task, batches_for = task_for(swarm.manifest)
        numel = sum(p.numel() for p in task.model.parameters())
        batches = batches_for(torch.Generator().manual_seed(0))
        started = time.perf_counter()
        for _ in range(3):
            task.loss(task.model, next(batches)).backward()
        compute = (time.perf_counter() - started) / 3
        task.model.zero_grad(set_to_none=True)
        print(f"  [ OK ] model ({task.name}, batch {settings.batch}): {numel / 1e6:.2f}M parameters, "
              f"{compute * 1e3:.0f} ms per step of compute here")
        if up and down:
            time.sleep(max(PACE_WINDOW_S - (time.monotonic() - first_read), 0.0))  # records refresh every few s
            later = swarm.loop.run(swarm.directory.peers(), timeout=30)
            step_s = group_pace(records, later, time.monotonic() - first_read)
            role = link_role(numel=numel, peers=max(len(later), 1) + 1, up_mbit=up, down_mbit=down,
                             group_step_s=step_s, compute_s=compute)
            print(f"  [{'OK' if role.role == 'voter' else 'WARN':^4}] role: {role.line}")
        else:
            print("  [WARN] no bandwidth figure (no synced member answered the probe): cannot estimate round time")
        return 0
    finally:
        swarm.shutdown()
