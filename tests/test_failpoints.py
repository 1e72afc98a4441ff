"""Failpoints: the env spec is parsed strictly, and an armed process really dies by SIGKILL at its point."""
import signal
import subprocess
import sys

import pytest

from lioncub_p2p import failpoints


def test_parse():
    assert failpoints.parse(None) is None and failpoints.parse("") is None
    assert failpoints.parse("result@20") == ("result", 20)
    assert failpoints.parse("serve") == ("serve", 0)
    with pytest.raises(ValueError, match="unknown point 'results'"):
        failpoints.parse("results@2")
    with pytest.raises(ValueError, match="must be an integer"):
        failpoints.parse("upload@soon")


def test_parse_hang():
    assert failpoints.parse_hang(None) is None and failpoints.parse_hang("") is None
    assert failpoints.parse_hang("20:12") == (20, 12.0)
    for bad in ("20", "soon:3", "20:-1", "-1:3", "20:1e9"):
        with pytest.raises(ValueError, match="LIONCUB_HANG"):
            failpoints.parse_hang(bad)


def _armed(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter whose environment holds only ``env`` (and an empty PATH)."""
    return subprocess.run([sys.executable, "-c", code], env={**env, "PATH": ""}, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.slow
def test_armed_process_dies_at_its_point_and_step_only():
    code = ("from lioncub_p2p import failpoints as f\n"
            "f.reached('upload', 9); f.reached('momentum', 5); print('alive', flush=True); f.reached('upload', 10)\n"
            "print('unreachable', flush=True)")
    done = _armed(code, LIONCUB_FAILPOINT="upload@10")
    assert done.returncode == -signal.SIGKILL and done.stdout == "alive\n"


@pytest.mark.slow
def test_a_hang_sleeps_once_at_its_step_only():
    code = ("import time\nfrom lioncub_p2p import failpoints as f\n"
            "for step in range(6):\n"
            "    t = time.monotonic(); f.before_step(step); print(step, round(time.monotonic() - t, 1), flush=True)\n")
    done = _armed(code, LIONCUB_HANG="3:0.5")
    slept = {int(s): float(t) for s, t in (line.split() for line in done.stdout.splitlines())}
    assert sorted(slept) == list(range(6)) and slept[3] >= 0.5, done.stdout + done.stderr
    assert all(slept[step] < 0.3 for step in (0, 1, 2, 4, 5)), done.stdout  # once, at its step only
