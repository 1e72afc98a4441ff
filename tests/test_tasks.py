"""Training tasks: the built-ins train, a user's module:function trains through lioncub-train, and the
task contract (batches, evaluation, loading) holds what lioncub_p2p/tasks/__init__.py promises."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lioncub_p2p import LionCub
from lioncub_p2p.swarm import snapshot
from lioncub_p2p.tasks import TaskError, TrainingTask, builtin_args, check_args, load_task, param_count

USER_TASK = '''
import torch
from torch import nn

BATCHES = [(torch.linspace(-1, 1, 24).reshape(6, 4) * (k + 1), torch.linspace(0.5, -0.7, 6).reshape(6, 1) * (k - 1.3))
           for k in range(3)]


def make_task(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    loss = lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1])
    evaluate = lambda model: float(sum(loss(model, b) for b in BATCHES) / len(BATCHES))
    return model, BATCHES, loss, evaluate
'''


def _lion_reference(params: list[np.ndarray], grad_fn, batches, steps: int, lr: float, wd: float,
                    b1: float = 0.9, b2: float = 0.99) -> list[np.ndarray]:
    """Plain Lion in numpy (float64 momenta compare within float32 rounding of the torch path)."""
    m = [np.zeros_like(p) for p in params]
    for step in range(steps):
        grads = grad_fn(params, batches[step % len(batches)])
        for i, (p, g) in enumerate(zip(params, grads)):
            c = b1 * m[i] + (1 - b1) * g
            assert np.all(c != 0), "a zero direction would take the shared tie-break bits"
            params[i] = p * (1 - lr * wd) - lr * np.sign(c)
            m[i] = b2 * m[i] + (1 - b2) * g
    return params


@pytest.mark.slow
def test_user_task_module_function_trains_alone(tmp_path):
    """--task mytask:make_task from the folder that holds mytask.py: a founder alone is plain Lion, so its
    final parameters equal a numpy Lion on the same batches (the list restarts after 3 batches)."""
    (tmp_path / "mytask.py").write_text(textwrap.dedent(USER_TASK))
    steps, lr, wd = 7, 0.01, 0.1
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "lioncub_p2p.cli.train", "--task", "mytask:make_task", "--seed", "3",
                           "--run-id", "user-task", "--steps", str(steps), "--lr", str(lr), "--weight-decay", str(wd),
                           "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--quiet", "--final-state", "final.state",
                           "--final-eval", "eval.json", "--momentum-every", "0"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"finished at step {steps}: test loss" in done.stdout

    sys.path.insert(0, str(tmp_path))
    try:
        import mytask
    finally:
        sys.path.remove(str(tmp_path))
    model, batches, loss_fn, _ = mytask.make_task(3)
    start = [p.detach().double().numpy().copy() for p in model.parameters()]

    def grads(params, batch):
        with torch.no_grad():
            for p, value in zip(model.parameters(), params):
                p.copy_(torch.from_numpy(value))
        model.zero_grad()
        loss_fn(model, batch).backward()
        return [p.grad.double().numpy() for p in model.parameters()]

    expected = _lion_reference(start, grads, batches, steps, lr, wd)
    trained, _, _, _ = mytask.make_task(0)  # another init: the snapshot must overwrite every value
    assert snapshot.load(LionCub(trained.named_parameters(), lr=lr), (tmp_path / "final.state").read_bytes()) == steps
    for got, want in zip(trained.parameters(), expected):
        np.testing.assert_allclose(got.detach().double().numpy(), want, rtol=0, atol=1e-5)
    assert '"eval_loss"' in (tmp_path / "eval.json").read_text()


def _unigram_entropy_nats(data: torch.Tensor) -> float:
    counts = np.bincount(data.numpy(), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def test_byte_gpt_trains_and_beats_byte_frequencies():
    """40 Lion steps of a 32-wide byte GPT: the test loss starts near a uniform guess over 256 bytes and
    ends below the entropy of the test bytes' own frequencies (what no context-free model can beat)."""
    torch.set_num_threads(1)
    from lioncub_p2p.tasks.byte_gpt import stdlib_bytes_task

    task = load_task("byte-gpt", seed=0, hidden=32)
    batches = task.checked_batches(16)(torch.Generator().manual_seed(1))
    before = task.evaluation()
    assert abs(before["loss"] - math.log(256)) < 0.8
    assert before["bits_per_byte"] == pytest.approx(before["loss"] / math.log(2))
    optimizer = LionCub(task.model.parameters(), lr=3e-3)
    for _ in range(40):
        task.loss(task.model, next(batches)).backward()
        optimizer.step()
        optimizer.zero_grad()
    after = task.evaluation()
    assert after["loss"] < _unigram_entropy_nats(stdlib_bytes_task().test) < before["loss"]


def test_digits_task_is_the_mlp_on_digits():
    task = load_task("digits", seed=0, hidden=16)
    x, y = task.checked_batches(5)(torch.Generator().manual_seed(0)).__next__()
    assert x.shape == (5, 64) and y.shape == (5,) and y.dtype == torch.int64
    shapes = [tuple(p.shape) for p in task.model.parameters()]
    assert shapes == [(16, 64), (16,), (16, 16), (16,), (10, 16), (10,)]
    result = task.evaluation()
    assert set(result) == {"loss", "accuracy"} and 0 <= result["accuracy"] <= 100


def test_digits_are_read_from_scikit_learns_file_as_load_digits_gives_them(monkeypatch):
    from sklearn.datasets import load_digits

    from lioncub_p2p.tasks import digits

    reference = load_digits()
    pixels, labels = digits._load_digits()
    np.testing.assert_array_equal(pixels, reference.data)
    np.testing.assert_array_equal(labels, reference.target)
    monkeypatch.setattr(digits.Path, "is_file", lambda self: False)  # the file moved: the import's way
    moved_pixels, moved_labels = digits._load_digits()
    np.testing.assert_array_equal(moved_pixels, reference.data)
    np.testing.assert_array_equal(moved_labels, reference.target)


def test_batches_restart_a_list_and_end_a_generator():
    model = nn.Linear(2, 1)
    loss = lambda m, b: m(b).sum()  # noqa: E731
    listed = TrainingTask(model, [torch.ones(1, 2) * k for k in range(3)], loss)
    stream = listed.checked_batches(4)(torch.Generator())
    assert [int(next(stream)[0, 0]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    once = TrainingTask(model, (torch.ones(1, 2) * k for k in range(3)), loss)
    assert [int(b[0, 0]) for b in once.checked_batches(4)(torch.Generator())] == [0, 1, 2]


def test_sampler_draws_from_the_peer_generator_after_the_check():
    """The startup check must not consume the peer's own draws: the first batch equals a fresh draw."""
    drawn = []

    def sample(batch, gen):
        drawn.append(batch)
        return torch.rand(batch, 2, generator=gen)

    task = TrainingTask(nn.Linear(2, 1), sample, lambda m, b: m(b).sum())
    first = next(task.checked_batches(3)(torch.Generator().manual_seed(7)))
    assert torch.equal(first, torch.rand(3, 2, generator=torch.Generator().manual_seed(7)))
    assert drawn == [3, 3]


def test_evaluation_takes_a_float_or_named_floats():
    model = nn.Linear(2, 1)
    loss = lambda m, b: m(b).sum()  # noqa: E731
    assert TrainingTask(model, [torch.ones(1, 2)], loss, lambda m: 1.5).evaluation() == {"loss": 1.5}
    assert TrainingTask(model, [torch.ones(1, 2)], loss, lambda m: {"loss": 2, "acc": torch.tensor(0.5)}) \
        .evaluation() == {"loss": 2.0, "acc": 0.5}
    assert TrainingTask(model, [torch.ones(1, 2)], loss).evaluation() == {}
    with pytest.raises(TaskError, match="must return a float"):
        TrainingTask(model, [torch.ones(1, 2)], loss, lambda m: "good").evaluation()
    seen = []
    TrainingTask(model, [torch.ones(1, 2)], loss, lambda m: seen.append((m.training, torch.is_grad_enabled())) or 0.0) \
        .evaluation()
    assert seen == [(False, False)] and model.training  # evaluated in eval mode without gradients, then restored


def test_function_gets_only_the_options_it_names(tmp_path, monkeypatch):
    (tmp_path / "opts.py").write_text(textwrap.dedent('''
        import torch
        from torch import nn
        SEEN = []
        def named(seed, batch):
            SEEN.append(("named", seed, batch))
            return nn.Linear(2, 1), [torch.ones(1, 2)], lambda m, b: m(b).sum()
        def nothing():
            SEEN.append(("nothing",))
            return nn.Linear(2, 1), [torch.ones(1, 2)], lambda m, b: m(b).sum()
        def everything(**options):
            SEEN.append(("everything", sorted(options.items())))
            return nn.Linear(2, 1), [torch.ones(1, 2)], lambda m, b: m(b).sum()
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    import opts

    for name in ("named", "nothing", "everything"):
        task = load_task(f"opts:{name}", seed=4, batch=9, hidden=None)
        assert task.name == f"opts:{name}"
    assert opts.SEEN == [("named", 4, 9), ("nothing",), ("everything", [("batch", 9), ("hidden", None), ("seed", 4)])]
    assert Path(opts.__file__).parent == tmp_path


def test_the_readme_task_example_trains(tmp_path, monkeypatch):
    """README's "Bring your own model" mytask.py, verbatim: it loads as --task mytask:make_task would, and
    60 Lion steps bring its loss well below the variance of its targets (what predicting 0 scores)."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if b.startswith("# mytask.py")]
    (tmp_path / "readme_task.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    torch.set_num_threads(1)
    task = load_task("readme_task:make_task", seed=0, batch=64, hidden=None)
    batches = task.checked_batches(64)(torch.Generator().manual_seed(5))
    x, y = next(batches)
    baseline = float(y.pow(2).mean())
    optimizer = LionCub(task.model.parameters(), lr=3e-3)
    for _ in range(60):
        loss = task.loss(task.model, next(batches))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        final = float(task.loss(task.model, (x, y)))
    assert final < 0.2 * baseline, (final, baseline)


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_builtin_param_counts_are_predicted_as_built():
    """param_count (digits: a build on the meta device; byte-gpt: a formula) equals the model load_task builds,
    and the MLP's formula."""
    from lioncub_p2p.tasks.byte_gpt import ByteGPT

    torch.set_num_threads(1)
    for hidden in (None, 16):
        assert param_count("digits", **({"hidden": hidden} if hidden else {})) == \
            _count(load_task("digits", seed=0, hidden=hidden).model)
        assert param_count("byte-gpt", **({"hidden": hidden} if hidden else {})) == \
            _count(load_task("byte-gpt", seed=0, hidden=hidden).model)
    for hidden in (1, 300, 4096):
        assert param_count("digits", hidden=hidden) == 64 * hidden + hidden + hidden * hidden + hidden + 10 * hidden + 10
    for hidden in (8, 512, 1000):
        assert param_count("byte-gpt", hidden=hidden) == _count(ByteGPT(64, hidden))


def test_the_largest_builtin_models_are_counted_without_allocating_them(monkeypatch):
    devices = []
    register = nn.Module.register_parameter

    def recording(self, name, param):
        if param is not None:
            devices.append(param.device.type)
        return register(self, name, param)

    monkeypatch.setattr(nn.Module, "register_parameter", recording)
    counts = [param_count("digits", hidden=4096), param_count("byte-gpt", hidden=1024)]
    assert counts == [17_088_522, 25_784_576]  # 68 MB and 103 MB of fp32 weights, had they been built
    # digits' six parameters on the meta device; byte-gpt's from its formula: nothing built, no memory behind it
    assert devices == ["meta"] * 6


@pytest.mark.parametrize("task, values, words", [
    ("digits", {"hidden": 4097}, ["--hidden 4097: task digits takes hidden as an integer from 1 to 4096"]),
    ("digits", {"hidden": 0}, ["from 1 to 4096"]),
    ("digits", {"hidden": 64.0}, ["--hidden 64.0", "an integer"]),
    ("digits", {"hidden": True}, ["an integer"]),
    ("digits", {"width": 64}, ["task digits takes no argument 'width' (it takes hidden)"]),
    ("byte-gpt", {"hidden": 4}, ["a multiple of its 4 attention heads from 8 to 1024"]),
    ("byte-gpt", {"hidden": 1028}, ["from 8 to 1024"]),
    ("byte-gpt", {"hidden": 130}, ["a multiple of its 4 attention heads"]),
])
def test_builtin_arguments_out_of_their_range(task, values, words):
    with pytest.raises(TaskError) as e:
        check_args(task, values)
    assert all(word in str(e.value) for word in words), str(e.value)


def test_builtin_arguments_in_range_pass_and_name_where_they_came_from():
    assert check_args("digits", {"hidden": 4096}) == {"hidden": 4096}
    assert check_args("byte-gpt", {"hidden": 8}) == {"hidden": 8} and check_args("byte-gpt", {}) == {}
    assert set(builtin_args("digits")) == set(builtin_args("byte-gpt")) == {"hidden"}
    with pytest.raises(TaskError, match=r"^run r's task_args.hidden=9000: task digits"):
        check_args("digits", {"hidden": 9000}, lambda key, value: f"run r's task_args.{key}={value!r}")


def test_load_task_refuses_a_builtin_width_out_of_range_before_building(monkeypatch):
    from lioncub_p2p.tasks import digits

    monkeypatch.setattr(digits, "digits", lambda **_: pytest.fail("the digits task was built"))
    with pytest.raises(TaskError, match="--hidden 12000: task digits takes hidden as an integer from 1 to 4096"):
        load_task("digits", seed=0, hidden=12000)
