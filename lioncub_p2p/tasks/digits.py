"""scikit-learn's digits (1,797 real 8x8 scans, shipped with scikit-learn, offline) and an MLP.

scikit-learn is an optional dependency (``pip install 'lioncub-p2p[sim]'``): the data is read from
its file when the task is loaded, and everything else in lioncub-p2p works without it.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .contract import IntArg, TaskError, TrainingTask

DEFAULT_HIDDEN = 256
D_IN, CLASSES = 64, 10  # 8x8 pixels, ten digits
# what a run's manifest (task_args) may set: 4096 wide is 17M parameters (~200 MB with Lion's momentum and the
# gradients), already far more than 1,797 images use, and room for the simulator's 2300-wide stress model
ARGS = {"hidden": IntArg(1, 4096)}


def mlp(d_in: int, hidden: int, classes: int) -> nn.Sequential:
    """The digits MLP: two hidden layers of ``hidden`` units."""
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


def param_count(hidden: int | None = None) -> int:
    """The built-in model's parameter count, from a build on the meta device: nothing is allocated."""
    with torch.device("meta"):
        return sum(p.numel() for p in mlp(D_IN, hidden or DEFAULT_HIDDEN, CLASSES).parameters())


@dataclass
class Task:
    """Train/test tensors and a model factory; ``shard`` splits the training set among workers."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    hidden: int = DEFAULT_HIDDEN

    def make_model(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return mlp(self.x_train.shape[1], self.hidden, int(self.y_train.max()) + 1)

    def shard(self, index: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x_train[index::count], self.y_train[index::count]

    def sample(self, shard: int, shards: int, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.shard(shard, shards)
        idx = torch.randint(0, len(x), (batch,), generator=gen)
        return x[idx], y[idx]

    @staticmethod
    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """(test loss, test accuracy in %)."""
        logits = model(self.x_test)
        loss = nn.functional.cross_entropy(logits, self.y_test).item()
        return loss, 100.0 * (logits.argmax(1) == self.y_test).float().mean().item()


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(pixels, labels) as ``sklearn.datasets.load_digits`` gives them, read from the file it reads:
    importing scikit-learn takes ~1 s of CPU, a fifth of a trainer process's start; the import is the
    fallback if its data file moved."""
    missing = TaskError("the digits task needs scikit-learn, which the core install leaves out: "
                        "pip install 'lioncub-p2p[sim]' (or train another task: --task byte-gpt)")
    try:
        spec = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        raise missing
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        try:
            rows = np.loadtxt(path, delimiter=",")
            return rows[:, :-1], rows[:, -1].astype(np.int64)
        except (OSError, ValueError):  # unreadable here: scikit-learn's own loader says why
            pass
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise missing from None
    data = load_digits()
    return data.data, data.target


def digits_task(seed: int = 0, hidden: int = DEFAULT_HIDDEN) -> Task:
    """80/20 split of the digits, standardized with the training split's statistics."""
    pixels, labels = _load_digits()
    x = pixels.astype(np.float32)
    y = labels.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    mean, std = x[:cut].mean(0), x[:cut].std(0) + 1e-6
    x = (x - mean) / std
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return Task("digits", t(x[:cut]), t(y[:cut]), t(x[cut:]), t(y[cut:]), hidden=hidden)


def digits(seed: int = 0, hidden: int | None = None) -> TrainingTask:
    """The built-in ``--task digits``: the MLP (``--hidden`` units, 2 hidden layers) on the digits.

    The data split is fixed (seed 0) on every peer; ``seed`` initializes the model."""
    data = digits_task(seed=0, hidden=hidden or DEFAULT_HIDDEN)

    def evaluate(model: nn.Module) -> dict[str, float]:
        loss, accuracy = data.evaluate(model)
        return {"loss": loss, "accuracy": accuracy}

    return TrainingTask(model=data.make_model(seed), data=lambda batch, gen: data.sample(0, 1, batch, gen),
                        loss=lambda model, batch: data.loss(model, *batch), evaluate=evaluate, name="digits")
