"""The README's organizer and volunteer commands, verbatim, each on its own host: an invited run.

One network namespace per host with added latency (20–40 ms each way), a coordinator and volunteers
on a public segment, one volunteer behind a NAT router (masquerade, no port forwarding), a late
joiner and a stranger. The commands are read from README.md and run as written, each volunteer in a
folder of its own: ``lioncub-invite id`` there, the organizer's ``lioncub-invite authority`` and
``issue`` beside the coordinator (the ticket is carried over as a volunteer would receive it), the
coordinator with its authority key. The test only substitutes the coordinator's address
(COORDINATOR_IP, PEER_ID) and each volunteer's peer id (VOLUNTEER_PEER_ID), and appends the flags that
bound and observe a run (--steps, --step-delay, --metrics-jsonl, --final-state, --quiet). Asserted:
everyone trains in one group, the NAT'd volunteer switches to client mode by itself and receives the
leader's group notices, the late joiner downloads the state, every volunteer exits 0 at the last step
with bitwise-equal parameters, the stranger (the README's command without a ticket) is refused in one
line, and no process is left.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lioncub_p2p.sim.hosts import HostNetwork, missing_tools
from lioncub_p2p.swarm import snapshot

from procs import kill_group, read_jsonl as metrics, wait_for

# whole trainer processes on shaped links: one such test at a time (conftest.py, xdist_group)
pytestmark = pytest.mark.xdist_group("processes")

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STEPS = 200


def readme_commands(program: str) -> list[str]:
    """Lines of README.md's bash blocks that run ``program`` (comments stripped)."""
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(program + " "):
                lines.append(line)
    return lines


def spawn(net: HostNetwork, host: str, command: str, workdir: Path, log: str) -> subprocess.Popen:
    """``command`` on ``host``, in ``workdir / host`` (each host's own folder: its key and ticket)."""
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    (workdir / host).mkdir(exist_ok=True)
    return subprocess.Popen(net.exec_prefix(host) + ["bash", "-c", command], cwd=workdir / host, env=env,
                            stdout=open(workdir / log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def run_invite(net: HostNetwork, host: str, command: str, workdir: Path) -> str:
    """A README ``lioncub-invite`` line on ``host``, in its folder: what it prints."""
    proc = spawn(net, host, command, workdir, f"{host}-invite.log")
    assert proc.wait(60) == 0, (workdir / f"{host}-invite.log").read_text()[-2000:]
    return (workdir / f"{host}-invite.log").read_text().strip().splitlines()[-1]


def log_tails(workdir: Path, hosts: tuple[str, ...], chars: int = 1500) -> dict[str, str]:
    return {h: (workdir / f"{h}.log").read_text()[-chars:] for h in hosts if (workdir / f"{h}.log").exists()}


@pytest.mark.slow
def test_readme_commands_on_separate_hosts_with_latency_and_nat(tmp_path):
    why = missing_tools(nat=True, delay=True)
    assert why is None, f"this test needs namespaces, a NAT router and added latency: {why}"
    (coordinator_cmd,) = [c for c in readme_commands("lioncub-coordinator") if "--host-maddrs" in c][:1]
    preflight_cmd, train_cmd = (readme_commands("lioncub-train") + ["", ""])[:2]
    assert "--preflight" in preflight_cmd and "--preflight" not in train_cmd, (preflight_cmd, train_cmd)
    invites = {c.split()[1]: c for c in readme_commands("lioncub-invite")}
    assert {"id", "authority", "issue"} <= set(invites) and "--authority-key" in coordinator_cmd, invites
    assert "--ticket ticket.txt" in train_cmd, train_cmd
    stranger_cmd = train_cmd.replace(" --ticket ticket.txt", "")  # what someone without an invitation runs
    # paced so that the run lasts over a minute: the late joiner (a preflight, then a start, each 10-40 s
    # on a loaded 2-core machine) must come in mid-run, not as the founders finish
    bounds = f" --steps {STEPS} --step-delay 0.3 --quiet"
    procs: list[subprocess.Popen] = []
    with HostNetwork() as net:
        coord = net.add_public("coord", delay_ms=20)
        for name, delay in (("v1", 20), ("v2", 40), ("late", 25), ("stranger", 20)):
            net.add_public(name, delay_ms=delay)
        net.add_private("home", delay_ms=30)
        def pids(host: str) -> set[str]:
            return set(subprocess.run(["ip", "netns", "pids", net.hosts[host].namespace], capture_output=True,
                                      text=True).stdout.split())

        network_helpers = {h: pids(h) for h in ("v1", "v2", "home", "late", "stranger")}  # the latency delayers
        try:
            run_invite(net, "coord", invites["authority"], tmp_path)  # the organizer, once
            for host in ("v1", "v2", "home", "late"):  # each volunteer sends its peer id; the organizer signs
                volunteer_id = run_invite(net, host, invites["id"], tmp_path)
                run_invite(net, "coord", invites["issue"].replace("VOLUNTEER_PEER_ID", volunteer_id), tmp_path)
                (tmp_path / host / "ticket.txt").write_bytes((tmp_path / "coord" / "ticket.txt").read_bytes())
            run_invite(net, "stranger", invites["id"], tmp_path)
            procs.append(spawn(net, "coord", coordinator_cmd, tmp_path, "coord.log"))
            printed = wait_for(lambda: re.search(r"/ip4/" + re.escape(coord.ip) + r"/tcp/31337/p2p/(\w+)",
                                                 (tmp_path / "coord.log").read_text()), 60, "the coordinator's address")
            peer_id = printed.group(1)

            def volunteer(host: str, command: str, extra: str) -> subprocess.Popen:
                line = command.replace("COORDINATOR_IP", coord.ip).replace("PEER_ID", peer_id) + extra
                proc = spawn(net, host, line, tmp_path, f"{host}.log")
                procs.append(proc)
                return proc

            founders = [volunteer(h, train_cmd, bounds + f" --metrics-jsonl ../{h}.jsonl --final-state ../{h}.state")
                        for h in ("v1", "v2", "home")]
            try:
                wait_for(lambda: any(r.get("peers", 0) >= 3 for r in metrics(tmp_path / "v1.jsonl")), 120,
                         "three volunteers voting in one round")
            except AssertionError as failed:  # name what each host printed, or the failure says nothing
                raise AssertionError(f"{failed}: {log_tails(tmp_path, ('coord', 'v1', 'v2', 'home'))}") from None
            stranger = volunteer("stranger", stranger_cmd, bounds)
            assert stranger.wait(120) == 1, (tmp_path / "stranger.log").read_text()[-2000:]
            # a volunteer checking first, while the run is on: the README's preflight command
            check = volunteer("late", preflight_cmd, "")
            assert check.wait(120) == 0, (tmp_path / "late.log").read_text()[-2000:]
            preflight_out = (tmp_path / "late.log").read_text()
            late = volunteer("late", train_cmd, bounds + " --metrics-jsonl ../late.jsonl --final-state ../late.state")
            codes = [p.wait(300) for p in founders + [late]]
            logs = {h: (tmp_path / f"{h}.log").read_text() for h in ("v1", "v2", "home", "late")}
            assert codes == [0, 0, 0, 0], {h: log[-1500:] for h, log in logs.items()}
            def leftover() -> dict[str, list[str]]:  # what still runs on each host, with its command line
                left = {h: sorted(pids(h) - network_helpers[h]) for h in ("v1", "v2", "home", "late", "stranger")}
                return {h: [subprocess.run(["ps", "-o", "pid=,args=", "-p", pid], capture_output=True,
                                           text=True).stdout.strip() or pid for pid in found]
                        for h, found in left.items() if found}

            try:  # a daemon killed by its exiting parent is reaped a moment later
                wait_for(lambda: not leftover(), 10, "no process left on the volunteers' hosts")
            except AssertionError:
                pass  # named below, with the command lines
            left = leftover()
        finally:
            for proc in procs:
                kill_group(proc)
    assert not left, f"processes left after the trainers exited: {left}"
    assert "[ OK ]" in preflight_out and "[FAIL]" not in preflight_out, preflight_out
    refused = [line for line in (tmp_path / "stranger.log").read_text().splitlines() if line.startswith("error:")]
    assert len(refused) == 1 and "invited-only" in refused[0] and "Traceback" not in (tmp_path / "stranger.log").read_text(), refused
    assert "client mode" in logs["home"], logs["home"][-2000:]  # chosen by itself: the command has no flag for it
    # the leader's group notices reach the NAT'd volunteer too (over the connection it opened: nobody can dial it)
    assert re.search(r"group epoch \d+ from step \d+ pushed at step", logs["home"]), logs["home"][-2000:]
    late_rows = metrics(tmp_path / "late.jsonl")
    assert late_rows and late_rows[0]["step"] > 0, "the late joiner did not start from the swarm's step"
    assert late_rows[0]["step"] <= STEPS - 30, f"the late joiner came in at step {late_rows[0]['step']} of {STEPS}"
    # the same step and parameters (momenta are each peer's own; the default sync streams 1/20 per step)
    states = {h: snapshot.step_and_params_digest((tmp_path / f"{h}.state").read_bytes())
              for h in ("v1", "v2", "home", "late")}
    assert all(s == states["v1"] for s in states.values()), f"volunteers ended with different parameters: {states}"
    assert max(r.get("peers", 0) for r in late_rows) >= 4, "the late joiner never voted with all four"
    print({h: log.splitlines()[:3] for h, log in logs.items()}, shlex.quote(train_cmd))
