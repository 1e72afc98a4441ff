"""The swarm as volunteers run it: separate processes on loopback, started from docker-compose.yml's
own command lines (no Docker engine here), trainers joining through those coordinators."""
from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import pytest
import yaml

from lioncub_p2p.swarm import snapshot

from procs import Processes, last_step, read_jsonl, wait_for_file

# whole trainer processes on shaped links: one such test at a time (conftest.py, xdist_group)
pytestmark = pytest.mark.xdist_group("processes")

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"


def compose_command(service: str, run_id: str, data: Path, bootstrap: Path, port: int) -> list[str]:
    """A compose service's command line, made runnable on loopback: volumes become folders,
    published ports free ones, compose service names 127.0.0.1."""
    command = yaml.safe_load(COMPOSE.read_text())["services"][service]["command"]
    command = command.replace("${RUN_ID:-demo}", run_id).replace("${PUBLIC_IP:-127.0.0.1}", "127.0.0.1")
    command = re.sub(r"/(tcp|udp)/3133[78]", rf"/\1/{port}", command)
    command = command.replace("/data/", f"{data}/").replace("/bootstrap/", f"{bootstrap}/")
    argv = shlex.split(command)
    if "--write-maddrs-host" in argv:  # containers reach each other by name; here everything is 127.0.0.1
        i = argv.index("--write-maddrs-host")
        del argv[i : i + 2]
    return ["lioncub_p2p.cli.coordinator"] + (["--client-mode", "--monitor"] if argv[0] == "lioncub-monitor" else []) \
        + argv[1:] + ["--monitor-period", "1"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(name: str, tmp: Path, bootstrap: Path, *extra: str) -> list[str]:
    return ["lioncub_p2p.cli.train", "--run-id", "ci", "--initial-peers-file", str(bootstrap / "coordinator-a.maddrs"),
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
            "--steps", str(STEPS), "--step-delay", "0.25", "--quiet", "--upload-timeout", "2", "--result-timeout", "4",
            "--momentum-every", "10", "--lr", "1e-3", "--metrics-jsonl", str(tmp / f"{name}.jsonl"),
            "--final-state", str(tmp / f"{name}.state"), *extra]


STEPS = 100


def _params(path: Path) -> bytes:
    blob = path.read_bytes()
    header, offset = snapshot.read_header(blob)
    nparams = sum(1 for name, _, _ in header["tensors"] if name.startswith("param:"))
    size = 0
    for name, dtype, shape in header["tensors"][:nparams]:
        n = 1
        for d in shape:
            n *= d
        size += n * 4
    return blob[offset : offset + size]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_trainers_kill_join_client_mode(tmp_path):
    bootstrap = tmp_path / "bootstrap"
    bootstrap.mkdir()
    procs = Processes(tmp_path)
    try:
        for service in ("coordinator-a", "coordinator-b", "monitor"):
            data = tmp_path / service
            data.mkdir()
            procs.start(service, compose_command(service, "ci", data, bootstrap, _free_port()))
            if service == "coordinator-a":
                wait_for_file(bootstrap / "coordinator-a.maddrs", 60)
        wait_for_file(bootstrap / "coordinator-b.maddrs", 60)
        for i in range(3):
            procs.start(f"t{i}", _trainer(f"t{i}", tmp_path, bootstrap, "--seed", str(i)))
        procs.start("client", _trainer("client", tmp_path, bootstrap, "--client-mode", "--seed", "9"))

        killed = joined = False
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            step = max(last_step(tmp_path / f"t{i}.jsonl") for i in range(3))
            if step >= 20 and not killed:
                procs.kill("t2")  # the machine dies: trainer, its DHT and daemons at once
                killed = True
            if step >= 30 and not joined:
                procs.start("late", _trainer("late", tmp_path, bootstrap, "--seed", "5"))
                joined = True
            if joined and all(procs.procs[n].poll() is not None for n in ("t0", "t1", "client", "late")):
                break
            time.sleep(0.1)
        survivors = ["t0", "t1", "client", "late"]
        procs.wait(survivors, timeout=max(deadline - time.monotonic(), 1))
        for name in survivors:
            assert procs.procs[name].returncode == 0, procs.log(name)[-3000:]

        params = {name: _params(tmp_path / f"{name}.state") for name in survivors}
        assert all(p == params["t0"] for p in params.values()), "final parameters differ"
        for name in survivors:
            assert snapshot.read_header((tmp_path / f"{name}.state").read_bytes())[0]["step"] == STEPS

        t0 = read_jsonl(tmp_path / "t0.jsonl")
        first, last = [r["loss"] for r in t0[:8]], [r["loss"] for r in t0[-8:]]
        assert sum(last) / len(last) < 0.7 * sum(first) / len(first), "loss did not fall"
        late = read_jsonl(tmp_path / "late.jsonl")
        # joined mid-run (a process start under load takes seconds: up to ~40 steps), kept up to the end
        assert 30 <= late[0]["step"] <= STEPS - 10 and late[-1]["step"] == STEPS - 1
        assert len(late) >= STEPS - late[0]["step"] - 2  # voted in (nearly) every round after joining
        client = read_jsonl(tmp_path / "client.jsonl")
        assert client[-1]["step"] == STEPS - 1 and len(client) >= STEPS - 10  # took part throughout
        assert max(r["peers"] for r in client) >= 4  # its votes were counted alongside the others
        monitor = read_jsonl(tmp_path / "monitor" / "monitor.jsonl")
        assert max(m["peers_alive"] for m in monitor) >= 4 and max(m["global_step"] for m in monitor) > 20
    finally:
        procs.close()
