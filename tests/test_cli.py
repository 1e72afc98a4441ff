"""Volunteer-facing commands: preflight verdicts, errors a person can act on, metrics plots."""
import json
import subprocess
import sys
import time
from pathlib import Path

from procs import Processes, wait_for_file


def _train(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lioncub_p2p.cli.train", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def test_preflight_reports_each_check(tmp_path):
    procs = Processes(tmp_path)
    try:
        procs.start("coord", ["lioncub_p2p.cli.coordinator", "--run-id", "pf", "--write-maddrs", str(tmp_path / "a")])
        wait_for_file(tmp_path / "a", 60)
        procs.start("t0", ["lioncub_p2p.cli.train", "--run-id", "pf", "--initial-peers-file", str(tmp_path / "a"),
                           "--steps", "100000", "--step-delay", "0.05", "--quiet"])
        time.sleep(8)
        done = _train("--run-id", "pf", "--initial-peers-file", str(tmp_path / "a"), "--preflight", cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr[-2000:]
        out = done.stdout
        assert "[ OK ] coordinators answer: 1 peers online" in out
        assert "peers probably cannot dial you" in out  # 127.0.0.1 only: advice to use --client-mode
        assert "bandwidth to" in out and "Mbit/s" in out and "per round" in out
        wrong = _train("--run-id", "other-run", "--initial-peers-file", str(tmp_path / "a"), "--preflight",
                       cwd=tmp_path)
        assert wrong.returncode == 3 and "is --run-id right?" in wrong.stdout
    finally:
        procs.close()


def test_unreachable_coordinator_is_one_clear_line(tmp_path):
    done = _train("--run-id", "x", "--initial-peers",
                  "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWA5YjZ5cu4eMJ8tdUuDAm8pjZdBHghmLpgNybBqdvyVhd", cwd=tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: could not start the DHT") and "--initial-peers" in last


def test_plot_turns_metrics_into_png(tmp_path):
    metrics = tmp_path / "peer0.jsonl"
    rows = [dict(step=i, loss=2.0 / (i + 1), compute_s=0.01, step_s=0.05, wait_s=0.01, bytes_up=1000, bytes_down=900,
                 time=1000.0 + 0.06 * i) for i in range(30)]
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken")
    done = subprocess.run([sys.executable, "-m", "lioncub_p2p.cli.plot", str(metrics), "--out", str(tmp_path / "m.png")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "m.png").stat().st_size > 10_000
    missing = subprocess.run([sys.executable, "-m", "lioncub_p2p.cli.plot", str(tmp_path / "nope.jsonl")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "does not exist" in missing.stderr


def test_metrics_go_to_jsonl_and_tensorboard_alike(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    done = _train("--run-id", "tb", "--steps", "12", "--quiet", "--metrics-jsonl", "m.jsonl", "--tensorboard", "tb",
                  cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    board = EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    logged = {e.step: e.value for e in board.Scalars("loss")}
    assert len(rows) == 12 and sorted(logged) == [r["step"] for r in rows]
    assert all(abs(logged[r["step"]] - r["loss"]) < 1e-6 * max(1.0, abs(r["loss"])) for r in rows)
    assert {"peers", "bits_per_param", "compute_s", "wait_s", "bytes_up"} <= set(board.Tags()["scalars"])
