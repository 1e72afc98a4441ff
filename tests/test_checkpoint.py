"""Checkpoints survive a writer killed mid-write: a subprocess saves over an existing checkpoint and is
SIGKILLed at a deterministic point (a hooked file object that writes half the bytes, syncs them and
waits; or just before the rename). The old checkpoint must still load with its exact values. The
same harness with a writer that writes straight to the target (what ``save`` must not do) leaves a
torn file that does not load: the check can fail."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lioncub_p2p import LionCub
from lioncub_p2p.swarm import checkpoint, snapshot

pytestmark = pytest.mark.slow  # each case starts a Python process

HERE = Path(__file__).resolve().parent

# The writer: the optimizer of seed 2 at step 7, saved over ``directory``'s checkpoint. ``mode`` picks
# where it stops and waits to be killed: "mid-write" (half of the bytes written and synced to the
# temporary file), "before-rename" (the temporary file complete), "direct" (half of the bytes written
# straight to the target: a non-atomic save), "complete" (no stop).
WRITER = r"""
import os, sys
from lioncub_p2p.swarm import checkpoint
from test_checkpoint import optimizer_at

directory, mode = sys.argv[1], sys.argv[2]
opt = optimizer_at(seed=2, step=7)

def stop(where):
    print(where, flush=True)
    sys.stdin.readline()  # the parent SIGKILLs this process here
    sys.exit("not killed")

class HalfThenStop:
    def __init__(self, f):
        self.f = f
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()
    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        os.fsync(self.f.fileno())
        stop(f"mid-write {len(data)}")
    def flush(self):
        self.f.flush()
    def fileno(self):
        return self.f.fileno()

def hooked_open(path, *args, **kwargs):
    if mode == "direct":
        path = os.path.join(directory, checkpoint.FILENAME)
    return HalfThenStop(open(path, *args, **kwargs))

if mode in ("mid-write", "direct"):
    checkpoint.open = hooked_open  # the module's name lookup finds this before the builtin
elif mode == "before-rename":
    real_replace = os.replace
    def replace(src, dst):
        stop(f"before-rename {os.path.getsize(src)}")
    os.replace = replace
checkpoint.save(directory, opt)
print("saved", flush=True)
"""


def optimizer_at(seed: int, step: int) -> LionCub:
    """A small model's optimizer with seeded parameters and momenta at ``step`` (the writer's too)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = LionCub(model.named_parameters())
    gen = torch.Generator().manual_seed(seed + 100)
    for _, m in opt.momentum_buffers():
        m.copy_(torch.randn(m.shape, generator=gen))
    for group in opt.param_groups:
        group["step"] = step
    return opt


def _state(opt: LionCub) -> list[torch.Tensor]:
    return [s.param.detach().clone() for s in opt.slots] + [m.clone() for _, m in opt.momentum_buffers()]


def _restored(directory: Path) -> tuple[int | None, list[torch.Tensor]]:
    """What ``restore`` loads into a fresh optimizer (zeroed first, so nothing is left over by chance)."""
    fresh = optimizer_at(seed=9, step=0)
    with torch.no_grad():
        for s in fresh.slots:
            s.param.zero_()
        for _, m in fresh.momentum_buffers():
            m.zero_()
    step = checkpoint.restore(directory, fresh)
    return step, _state(fresh)


def _write_and_kill(directory: Path, mode: str, timeout: float = 60.0) -> tuple[str, int]:
    """Run the writer; SIGKILL it where it stops. Returns (the line it stopped at, its exit status)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline().strip() if ready else ""
        if line.split(" ")[0] in ("mid-write", "before-rename"):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout)
        assert line, f"the writer said nothing in {timeout} s: {proc.stderr.read()[-2000:]}"
        return line, proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture
def saved(tmp_path) -> tuple[Path, list[torch.Tensor], bytes]:
    """A checkpoint of seed 1 at step 3: (directory, its tensors, its file's bytes)."""
    old = optimizer_at(seed=1, step=3)
    path = checkpoint.save(tmp_path, old)
    return tmp_path, _state(old), path.read_bytes()


@pytest.mark.parametrize("mode", ["mid-write", "before-rename"])
def test_writer_killed_mid_save_leaves_the_old_checkpoint(saved, mode):
    directory, old_tensors, old_bytes = saved
    new_size = len(snapshot.encode(optimizer_at(seed=2, step=7))[0])
    line, status = _write_and_kill(directory, mode)
    assert line.startswith(mode) and status == -signal.SIGKILL
    step, tensors = _restored(directory)
    assert step == 3 and all(torch.equal(a, b) for a, b in zip(tensors, old_tensors))
    assert (directory / checkpoint.FILENAME).read_bytes() == old_bytes
    # ...though it died with half (or all) of the new checkpoint written next to the old one
    assert int(line.split()[1]) == new_size
    (tmp,) = [p for p in directory.iterdir() if p.name != checkpoint.FILENAME]
    assert tmp.stat().st_size == (new_size // 2 if mode == "mid-write" else new_size)


def test_a_non_atomic_writer_killed_mid_save_tears_the_checkpoint(saved):
    """The control: writing straight to the target, the same kill leaves a file that does not load."""
    directory, _, old_bytes = saved
    line, status = _write_and_kill(directory, "direct")
    assert line.startswith("mid-write") and status == -signal.SIGKILL
    assert (directory / checkpoint.FILENAME).read_bytes() != old_bytes
    with pytest.raises(snapshot.SnapshotError):
        _restored(directory)


def test_a_completed_save_replaces_the_old_checkpoint(saved):
    directory, old_tensors, _ = saved
    line, status = _write_and_kill(directory, "complete")
    assert (line, status) == ("saved", 0)
    assert [p.name for p in directory.iterdir()] == [checkpoint.FILENAME]  # no temporary file left
    step, tensors = _restored(directory)
    expected = _state(optimizer_at(seed=2, step=7))
    assert step == 7 and all(torch.equal(a, b) for a, b in zip(tensors, expected))
    assert not all(torch.equal(a, b) for a, b in zip(tensors, old_tensors))
