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


@pytest.mark.slow
def test_armed_process_dies_at_its_point_and_step_only():
    code = ("from lioncub_p2p import failpoints as f\n"
            "f.reached('upload', 9); f.reached('momentum', 5); print('alive', flush=True); f.reached('upload', 10)\n"
            "print('unreachable', flush=True)")
    done = subprocess.run([sys.executable, "-c", code], env={"LIONCUB_FAILPOINT": "upload@10", "PATH": ""},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL and done.stdout == "alive\n"
