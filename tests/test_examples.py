"""The examples run as users run them (separate processes), and say what they promise."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each runs an example as a separate process (5-15 s)

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 300) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_bring_your_own_template_trains_identical_peers():
    out = _run("examples/bring_your_own/template.py")
    assert "identical parameters: True" in out
    losses = [float(v) for v in out.split("final losses [")[1].split("]")[0].split(",")]
    assert max(losses) < 0.3  # the toy regression was learned (the target's variance is 2.2)


def test_digits_quickstart_alone_and_swarm():
    out = _run("examples/digits/quickstart.py", "--steps", "40", "--peers", "2")
    assert "parameters identical: True" in out
    swarm_acc = float(out.split("swarm:  test accuracy ")[1].split("%")[0])
    assert swarm_acc > 80.0


def test_byte_gpt_comparison_writes_curves(tmp_path):
    out = _run("examples/byte_gpt/compare.py", "--steps", "6", "--workers", "2", "--batch", "4", "--out", str(tmp_path))
    result = json.loads((tmp_path / "result.json").read_text())
    assert len(result) == 2 and all(0 < r["test_bits_per_byte"] < 9 for r in result.values())
    assert (tmp_path / "loss.png").stat().st_size > 5000 and "bits/byte" in out


@pytest.mark.slow
def test_the_readme_bring_your_own_model_block_trains_from_its_own_folder(tmp_path):
    """The README's mytask.py, written to a folder, and `lioncub-train --task mytask:make_task` run from
    there with the installed command (whose import path has no current folder: before, it stopped with
    "no module named 'mytask'")."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"```python\n(# mytask\.py\n.*?)```", readme, flags=re.S).group(1)
    (tmp_path / "mytask.py").write_text(block)
    command = Path(sys.executable).parent / "lioncub-train"
    done = subprocess.run([str(command), "--task", "mytask:make_task", "--run-id", "byo", "--steps", "3",
                           "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--quiet", "--linger", "0"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and "finished at step 3" in done.stdout, (done.stdout + done.stderr)[-2000:]
