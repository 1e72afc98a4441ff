"""Every class of user mistake ends in one line naming the problem and the fix, a non-zero exit, no
traceback, and nothing lost; the trainer finds them all before it starts a daemon or joins a run.

The tools run in-process (``main(argv)``): SystemExit with a string is what Python prints as one
line to stderr with exit status 1; ``test_errors_reach_the_shell_as_one_line`` checks that end to end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from lioncub_p2p import LionCub, MomentumSchedule
from lioncub_p2p.cli import coordinator, plot, train
from lioncub_p2p.sim import launcher
from lioncub_p2p.swarm import Manifest, checkpoint, snapshot
from lioncub_p2p.tasks.digits import digits_task

PEER_ID = "12D3KooWA5YjZ5cu4eMJ8tdUuDAm8pjZdBHghmLpgNybBqdvyVhd"
LOOPBACK = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]


@pytest.fixture(autouse=True)
def no_daemons(monkeypatch):
    """Every mistake here must be found before a DHT starts: starting one fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a daemon was started before the settings were checked")

    monkeypatch.setattr(train, "Swarm", refuse)
    monkeypatch.setattr(coordinator, "DHT", refuse)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # lioncub-train sets 1 for volunteers' machines


def one_line_error(main, argv: list[str], capsys, *words: str) -> str:
    """Run a tool's main; it must exit with one 'error: ...' line containing each of ``words``."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    message = exited.value.code
    assert isinstance(message, str), f"exit code {message!r} instead of a message"
    assert message.startswith("error: ") and "\n" not in message, message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    streams = capsys.readouterr()
    assert "Traceback" not in streams.err + streams.out
    return message


@pytest.mark.parametrize("content, words", [
    (None, ["does not exist", "peers:"]),
    ("peers: [{up: 100, down: 20}\n  - oops", ["not valid YAML", "line"]),
    ("peers:\n  - {up: 100, bandwidth: 20}\n", ["peer 0", "unknown field 'bandwidth'", "known:"]),
    ("peers:\n  - {up: 100}\n  - {up: -5}\n", ["peer 1", "rates must be positive"]),
    ("peers:\n  - {up: 100, failpoint: 'reslt@20'}\n", ["peer 0", "failpoint 'reslt@20'", "result"]),
    ("peer:\n  - {up: 100}\n", ["no `peers:` list", "peers: [{up: 100"]),
    ("- {up: 100}\n", ["no `peers:` list"]),
    ("peers:\n  - {up: fast}\n", ["peer 0", "up must be a number"]),
    ("peers:\n  - {up: 10, leave_at: 2.5}\n", ["peer 0", "leave_at is a round number"]),
    ("peers: []\n", ["non-empty list"]),
])
def test_sim_profile_mistakes(tmp_path, capsys, content, words):
    path = tmp_path / "peers.yaml"
    if content is not None:
        path.write_text(content)
    one_line_error(launcher.main, ["--profile", str(path), "--out", str(tmp_path / "out")], capsys,
                   f"--profile {path}", *words)
    assert not (tmp_path / "out").exists()  # nothing was started


@pytest.mark.parametrize("links", ["100,abc", "100/x", "", "100,-5"])
def test_sim_links_that_are_not_rates(tmp_path, capsys, links):
    message = one_line_error(launcher.main, ["--links", links, "--out", str(tmp_path / "out")], capsys, "--links")
    assert "100,50" in message or "positive" in message


@pytest.mark.parametrize("argv, words", [
    (["--lr", "-1"], ["--lr must be positive"]),
    (["--hidden", "0"], ["--hidden must be at least 1"]),
    (["--seconds", "nan"], ["--seconds must be positive"]),
    (["--linger", "-1"], ["--linger"]),
])
def test_sim_numbers_no_trainer_could_run_with_move_nothing(tmp_path, capsys, argv, words):
    out = tmp_path / "out"
    (out / "lioncub").mkdir(parents=True)
    (out / "report.json").write_text("{}")
    one_line_error(launcher.main, [*argv, "--out", str(out)], capsys, *words)
    assert sorted(p.name for p in out.iterdir()) == ["lioncub", "report.json"]


def test_sim_keeps_the_previous_results_aside():
    """Each method's folder is emptied before it runs and the report rewritten: an earlier run's go to a
    folder of their own first, and another user file stays where it was."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        assert launcher.keep_previous(out) is None
        (out / "lioncub").mkdir()
        (out / "lioncub" / "peer0.jsonl").write_text("old\n")
        (out / "report.json").write_text("{}")
        (out / "notes.txt").write_text("mine")
        first = launcher.keep_previous(out)
        assert first.name.startswith("previous-") and (first / "lioncub" / "peer0.jsonl").read_text() == "old\n"
        assert (first / "report.json").exists() and not (out / "lioncub").exists() and (out / "notes.txt").exists()
        (out / "report.json").write_text("{}")
        os.utime(out / "report.json", (first.stat().st_mtime, first.stat().st_mtime))  # the same second
        second = launcher.keep_previous(out)
        assert second != first and second.exists() and first.exists()


@pytest.mark.parametrize("main", [train.main, coordinator.main])
def test_run_id_with_a_dot(capsys, main):
    one_line_error(main, ["--run-id", "my.run"], capsys, "--run-id 'my.run'", "without dots", "--run-id my-run")


@pytest.mark.parametrize("flag, value, words", [
    ("--upload", "foo", ["--upload foo", "sign (1 bit) or l1:BITS"]),
    ("--upload", "l1:99", ["--upload l1:99", "2 <= bits <= 8"]),
    ("--upload", "l1:four", ["whole number"]),
    ("--upload", "bf16", ["not a vote encoding"]),
    ("--upload", "fp8", ["not a vote encoding"]),
    ("--momentum-wire", "fp4", ["--momentum-wire fp4", "bf16", "fp8"]),
    ("--result", "foo", ["--result foo", "majority | ternary | mean"]),
    ("--result", "average", ["not a vote result"]),
])
def test_unknown_vote_encodings(capsys, flag, value, words):
    one_line_error(train.main, [flag, value], capsys, *words)


@pytest.mark.parametrize("argv, words", [
    (["--batch", "0"], ["--batch must be at least 1"]),
    (["--steps", "-1"], ["--steps must be 0 or more"]),
    (["--upload-timeout", "30", "--result-timeout", "20"], ["less than --result-timeout"]),
    (["--lr", "0"], ["--lr"]),
    (["--hidden", "30", "--task", "byte-gpt"], ["multiple of its 4 attention heads"]),
    (["--hidden", "5000"], ["--hidden 5000: task digits takes hidden as an integer from 1 to 4096"]),
    (["--hidden", "2048", "--task", "byte-gpt"], ["--hidden 2048", "from 8 to 1024"]),
    (["--hidden", "64", "--max-params", "1000"], ["task digits with hidden 64 has 8,970 parameters",
                                                  "more than --max-params 1,000", "lower --hidden"]),
    (["--max-params", "0"], ["--max-params must be at least 1"]),
    (["--trust-task", "mytask"], ["--trust-task mytask: name a task as module:function"]),
    (["--trust-task", "digits"], ["a built-in task needs no trust"]),
    (["--trust-task", "a:b", "x;y:z"], ["--trust-task x;y:z"]),
    (["--max-group", "1"], ["max_group must be 0 (one flat group) or at least 2"]),
    (["--max-group", "8", "--result", "ternary"], ["max_group needs upload sign, result majority"]),
    (["--weight", "2e6"], ["--weight must be at most 1e+06"]),
    (["--weight", "inf"], ["--weight must be at most"]),
    (["--max-seconds", "-5"], ["--max-seconds must be 0 or more"]),
    (["--linger", "nan"], ["--linger must be 0 or more"]),
    (["--run-secret", ""], ["--run-secret (or $LIONCUB_RUN_SECRET) is empty", "is the variable you passed set?"]),
    (["--method", "hivemind-fp16", "--run-secret", "s", "--identity-path", "id.key"],
     ["hivemind-fp16", "has no --run-secret, --identity-path", "leave them out"]),
])
def test_numbers_out_of_range(capsys, argv, words):
    one_line_error(train.main, argv, capsys, *words)


def test_the_run_secret_from_the_environment_and_a_warning_for_a_short_one(capsys, monkeypatch):
    """--run-secret shows in the process list to every user of the machine: $LIONCUB_RUN_SECRET stands in
    for it, checked as the flag is. A short secret gets a warning (offline guessing from one admission
    exchange), not a refusal."""
    monkeypatch.setenv("LIONCUB_RUN_SECRET", "")
    one_line_error(train.main, [], capsys, "$LIONCUB_RUN_SECRET) is empty")
    monkeypatch.setenv("LIONCUB_RUN_SECRET", "x" * 32)
    one_line_error(train.main, ["--method", "hivemind-fp16"], capsys, "has no $LIONCUB_RUN_SECRET")
    monkeypatch.setenv("LIONCUB_RUN_SECRET", "s3cret")  # the next mistake stops it after the secret's checks
    with pytest.raises(SystemExit):
        train.main(["--upload-timeout", "30", "--result-timeout", "20"])
    assert "a run secret of 6 characters can be guessed offline" in capsys.readouterr().err
    monkeypatch.setenv("LIONCUB_RUN_SECRET", "x" * 32)
    with pytest.raises(SystemExit):
        train.main(["--upload-timeout", "30", "--result-timeout", "20"])
    assert "guessed" not in capsys.readouterr().err


def test_momentum_wire_alone_keeps_the_default_schedule():
    """No flag: the run's schedule (by default 1/20 streamed per step in fp8); a wire format alone changes
    only the format; a schedule alone takes the default format."""
    from lioncub_p2p.swarm.manifest import DEFAULTS

    def schedule(*argv):
        return train.momentum_schedule(train.parse_args(list(argv)))

    assert DEFAULTS.momentum_schedule() == MomentumSchedule(slices=20, wire="fp8")
    assert schedule() is None  # the run's
    assert schedule("--momentum-wire", "bf16") == MomentumSchedule(slices=20, wire="bf16")
    assert schedule("--momentum-wire", "fp8") == MomentumSchedule(slices=20, wire="fp8")
    assert schedule("--momentum-slices", "25", "--momentum-wire", "bf16") == MomentumSchedule(slices=25)
    assert schedule("--momentum-every", "5") == MomentumSchedule(every=5, wire="fp8")
    assert schedule("--momentum-every", "0") == MomentumSchedule(every=0, wire="fp8")  # never


def test_plot_of_files_that_are_not_metrics(tmp_path, capsys):
    monitor = tmp_path / "monitor.jsonl"  # valid JSON lines, but a monitor's, not a trainer's
    monitor.write_text(json.dumps({"time": 1.0, "peers_alive": 3, "global_step": 4}) + "\n")
    binary = tmp_path / "state.lcub"
    binary.write_bytes(bytes(range(256)) * 4)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for path, words in ((monitor, ["holds no metrics lines", "--metrics-jsonl"]),
                        (binary, ["not a metrics file", "--metrics-jsonl"]),
                        (empty, ["holds no metrics lines"]),
                        (tmp_path, ["is a folder"]),
                        (tmp_path / "missing.jsonl", ["does not exist"])):
        one_line_error(plot.main, [str(path), "--out", str(tmp_path / "m.png")], capsys, str(path), *words)
    assert not (tmp_path / "m.png").exists()


@pytest.mark.parametrize("main", [train.main, coordinator.main])
@pytest.mark.parametrize("flag, address, words", [
    ("--initial-peers", "/ip4/1.2.3.4/tcp/31337", ["lacks the peer id", "/p2p/"]),
    ("--initial-peers", "1.2.3.4:31337", ["is not a multiaddr", "Must begin with /"]),
    ("--initial-peers", "/ip4/1.2.3.4/tcp/31337/p2p/notapeerid", ["is not a multiaddr", "protocol p2p"]),
    ("--initial-peers", "/ip4/1.2.3.4/tcp/port/p2p/" + PEER_ID, ["is not a multiaddr", "protocol tcp"]),
    ("--host-maddrs", "/ip4/0.0.0.0/udp/0/quic", ["/quic-v1"]),
    ("--announce-maddrs", "203.0.113.7", ["is not a multiaddr"]),
])
def test_addresses_checked_before_the_dht_starts(capsys, main, flag, address, words):
    one_line_error(main, [flag, address], capsys, *words)


@pytest.mark.parametrize("content, words", [
    (None, ["cannot read the manifest"]),
    ("task: byte-gpt\nlearning_rate: 0.1\n", ["unknown field 'learning_rate'"]),
    ("task: [byte-gpt\n", ["not valid YAML"]),
    ("lr: -1\n", ["lr"]),
])
def test_coordinator_manifest_mistakes(tmp_path, capsys, content, words):
    path = tmp_path / "run.yaml"
    if content is not None:
        path.write_text(content)
    one_line_error(coordinator.main, ["--manifest", str(path), *LOOPBACK], capsys, f"--manifest {path}", *words)


def test_peers_file_with_a_bad_address(tmp_path, capsys):
    peers = tmp_path / "coordinator.maddrs"
    peers.write_text(f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER_ID}\n/ip4/127.0.0.1/tcp/31338\n")
    one_line_error(train.main, ["--initial-peers-file", str(peers)], capsys, str(peers), "lacks the peer id")


def test_unwritable_checkpoint_dir(tmp_path, capsys):
    """Root passes permission checks, so: a path below a regular file (it cannot be created), and an
    existing folder nobody can create files in (/proc/self: only writing a file there tells)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    one_line_error(train.main, ["--checkpoint-dir", str(blocker / "ckpt"), *LOOPBACK], capsys,
                   f"--checkpoint-dir {blocker / 'ckpt'}", "not a folder this process can write", "choose another")
    assert Path("/proc/self").is_dir()
    one_line_error(train.main, ["--checkpoint-dir", "/proc/self", *LOOPBACK], capsys,
                   "--checkpoint-dir /proc/self", "not a folder this process can write")
    one_line_error(train.main, ["--metrics-jsonl", str(blocker / "m.jsonl")], capsys, "--metrics-jsonl",
                   "choose another path")
    one_line_error(train.main, ["--tensorboard", str(blocker / "tb"), *LOOPBACK], capsys, "--tensorboard",
                   "not a folder this process can write")
    assert blocker.read_text() == "keep me"


def test_plot_names_runs_apart_and_refuses_an_image_format_it_cannot_write(tmp_path, capsys):
    """Every simulator method's folder holds a peer0.jsonl: two of them were one run, keyed by file name."""
    paths = [tmp_path / "lioncub" / "peer0.jsonl", tmp_path / "dlion" / "peer0.jsonl", tmp_path / "dlion" / "peer1.jsonl"]
    assert [plot.run_name(p, paths) for p in paths] == ["lioncub/peer0", "dlion/peer0", "peer1"]
    assert plot.run_name(paths[0], [paths[0], paths[0]]) == str(paths[0])
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps({"step": 0, "loss": 1.0, "time": 1.0, "compute_s": 0.1, "step_s": 0.2}) + "\n")
    one_line_error(plot.main, [str(metrics), "--out", str(tmp_path / "run.txt")], capsys, "--out", ".png, .pdf, .svg")


def test_long_runs_check_their_report_path_first_and_keep_an_earlier_report(tmp_path, capsys):
    """lioncub-compare and lioncub-reliability write their report after minutes or hours: an unwritable
    --out is one line before any run, and an earlier report moves aside instead of being overwritten."""
    from lioncub_p2p.sim import inprocess, reliability
    from lioncub_p2p.sim.report_files import keep_previous_report

    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    for main in (inprocess.main, reliability.main):
        one_line_error(main, ["--out", str(blocker / "report.json")], capsys, "--out", str(blocker / "report.json"))
    assert blocker.read_text() == "keep me"
    report = tmp_path / "reliability.json"
    assert keep_previous_report(report) is None
    report.write_text("old")
    aside = keep_previous_report(report)
    assert aside.name.startswith("reliability.previous-") and aside.suffix == ".json"
    assert aside.read_text() == "old" and not report.exists()
    report.write_text("newer")
    os.utime(report, (aside.stat().st_mtime, aside.stat().st_mtime))
    assert keep_previous_report(report) not in (None, aside) and aside.read_text() == "old"


def test_a_manifest_that_is_not_text(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"\xff\xfe\x00binary")
    one_line_error(coordinator.main, ["--manifest", str(path), *LOOPBACK], capsys, f"--manifest {path}",
                   "not a text (UTF-8) YAML file")


class SwarmThatMustNotBeJoined:
    """Stands in for the DHT: the run's manifest says nothing (digits, defaults); joining fails the test."""

    def __init__(self, config):
        self.config = config
        self.listen_plan = types.SimpleNamespace(note="")
        self.manifest = Manifest()
        self.shut = False

    def visible_maddrs(self) -> list[str]:
        return []

    def join(self, optimizer):
        raise AssertionError("joined the run with a checkpoint that does not fit")

    def shutdown(self) -> None:
        self.shut = True


def test_checkpoint_of_another_model(tmp_path, capsys, monkeypatch):
    """A checkpoint of a 32-wide MLP under --hidden 64 (and a torn one) is refused before joining, unchanged."""
    monkeypatch.setattr(train, "Swarm", SwarmThatMustNotBeJoined)
    model = digits_task(hidden=32).make_model(0)
    saved = checkpoint.save(tmp_path / "ckpt", LionCub(model.named_parameters(), lr=1e-3))  # as lioncub-train names them
    blob = saved.read_bytes()
    one_line_error(train.main, ["--checkpoint-dir", str(tmp_path / "ckpt"), "--hidden", "64", *LOOPBACK], capsys,
                   "checkpoint of another model", "--task and --hidden", "another --checkpoint-dir")
    assert saved.read_bytes() == blob
    saved.write_bytes(blob[:-100])
    one_line_error(train.main, ["--checkpoint-dir", str(tmp_path / "ckpt"), "--hidden", "32", *LOOPBACK], capsys,
                   "is truncated", "move it away")
    saved.write_bytes(b"not a snapshot")
    one_line_error(train.main, ["--checkpoint-dir", str(tmp_path / "ckpt"), "--hidden", "32", *LOOPBACK], capsys,
                   "not a readable checkpoint")
    assert saved.read_bytes() == b"not a snapshot"
    # another run's checkpoint of the same model: before, a new run in an old run's folder resumed its
    # weights and step silently (the default --run-id is the same for both)
    other = checkpoint.save(tmp_path / "old-run", LionCub(model.named_parameters(), lr=1e-3), "last-week")
    one_line_error(train.main, ["--checkpoint-dir", str(other.parent), "--hidden", "32", "--run-id", "this-week",
                                *LOOPBACK], capsys, "holds the state of run 'last-week', not 'this-week'",
                   "another --checkpoint-dir")
    fresh = LionCub(model.named_parameters(), lr=1e-3)
    with pytest.raises(snapshot.SnapshotError, match="not 'this-week'"):
        checkpoint.restore(other.parent, fresh, "this-week")
    assert checkpoint.restore(other.parent, fresh, "last-week") == 0
    assert checkpoint.restore(tmp_path / "ckpt-old", fresh, "x") is None


BAD_TASKS = textwrap.dedent('''
    import torch
    from torch import nn
    import_error = None
    def ok_model():
        return nn.Linear(2, 1)
    def returns_two():
        return ok_model(), [torch.ones(1, 2)]
    def returns_number():
        return 3
    def raises():
        raise RuntimeError("the dataset path\\nis missing")
    def vector_loss():
        return ok_model(), [torch.ones(3, 2)], lambda m, b: m(b)
    def detached_loss():
        return ok_model(), [torch.ones(3, 2)], lambda m, b: m(b).sum().detach()
    def no_batches():
        return ok_model(), [], lambda m, b: m(b).sum()
    def not_a_model():
        return "model", [torch.ones(1, 2)], lambda m, b: m(b).sum()
    def broken_sampler():
        return ok_model(), lambda batch, gen: 1 / 0, lambda m, b: m(b).sum()
    NOT_CALLABLE = 5
''')


@pytest.mark.parametrize("spec, words", [
    ("nosuchmodule:make", ["no module named 'nosuchmodule'", "PYTHONPATH"]),
    ("badtasks:missing", ["has no function 'missing'"]),
    ("badtasks:NOT_CALLABLE", ["not a function"]),
    ("badtasks:returns_two", ["must return (model, data, loss)", "a tuple of 2"]),
    ("badtasks:returns_number", ["of type int"]),
    ("badtasks:raises", ["raised RuntimeError: the dataset path is missing"]),
    ("badtasks:vector_loss", ["scalar float tensor"]),
    ("badtasks:detached_loss", ["no gradient flows"]),
    ("badtasks:no_batches", ["the data yields no batches"]),
    ("badtasks:not_a_model", ["torch.nn.Module"]),
    ("badtasks:broken_sampler", ["the data failed: ZeroDivisionError"]),
    ("gpt", ["not a built-in task (digits, byte-gpt)", "module:function"]),
    ("badtasks:", ["module:function"]),
])
def test_bad_task(tmp_path, monkeypatch, capsys, spec, words):
    (tmp_path / "badtasks.py").write_text(BAD_TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    one_line_error(train.main, ["--task", spec, *LOOPBACK], capsys, "--task" if ":" in spec or spec == "gpt" else "",
                   *words)


@pytest.mark.slow
def test_errors_reach_the_shell_as_one_line(tmp_path):
    """As a user sees them: status 1, exactly one line on stderr, nothing on stdout."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for module, argv in (("lioncub_p2p.cli.train", ["--run-id", "my.run"]),
                         ("lioncub_p2p.cli.train", ["--upload", "l1:99"]),
                         ("lioncub_p2p.sim.launcher", ["--links", "100,abc"]),
                         ("lioncub_p2p.cli.plot", [str(tmp_path)])):
        done = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, env=env)
        assert done.returncode == 1, (module, argv, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (module, argv, done.stderr)
        assert done.stdout == ""
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == []  # nothing written


def test_ticket_mistakes_end_in_one_line_before_anything_starts(tmp_path, capsys, monkeypatch):
    """A ticket for another run, one without the identity it admits, an unreadable, damaged or expired
    one, a key file passed as a ticket; and the coordinator's authority key missing or --revoked alone."""
    from lioncub_p2p.identity import Identity
    from lioncub_p2p.swarm.tickets import issue

    authority = Identity.load_or_create(tmp_path / "authority.key")
    me = Identity.load_or_create(tmp_path / "me.key")
    good = tmp_path / "t.txt"
    good.write_text(issue(authority, "demo", me.peer_id, days=1, max_weight=5).text())
    expired = tmp_path / "old.txt"
    expired.write_text(issue(authority, "demo", me.peer_id, days=1, max_weight=5, now=0.0).text())
    damaged = tmp_path / "bad.txt"
    damaged.write_text(good.read_text()[:-30] + "x")
    ident = ["--identity-path", str(tmp_path / "me.key")]
    cases = [(["--ticket", str(good)], ["admits one peer id", "--identity-path"]),
             (["--ticket", str(good), "--run-id", "other", *ident], ["for run demo", "--run-id demo"]),
             (["--ticket", str(tmp_path / "none.txt"), *ident], ["cannot read it"]),
             (["--ticket", str(tmp_path / "me.key"), *ident], ["not a ticket"]),
             (["--ticket", str(damaged), *ident], ["damaged"]),
             (["--ticket", str(expired), *ident], ["expired", "new one"])]
    for argv, words in cases:
        one_line_error(train.main, ["--run-id", "demo", *argv, *LOOPBACK], capsys, *words)
    monkeypatch.setenv("LIONCUB_TICKET", "lioncub-ticket:####")
    one_line_error(train.main, ["--run-id", "demo", *ident, *LOOPBACK], capsys, "$LIONCUB_TICKET", "damaged")
    one_line_error(coordinator.main, ["--authority-key", str(tmp_path / "missing.key")], capsys,
                   "does not exist", "lioncub-invite authority")
    one_line_error(coordinator.main, ["--revoked", str(tmp_path / "r.txt")], capsys, "--authority-key")
