"""Small real training tasks with offline data, shared by the simulators, examples and tests."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass
class Task:
    """Train/test tensors and a model factory; ``shard`` splits the training set among workers."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    hidden: int = 256

    def make_model(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        d_in, classes = self.x_train.shape[1], int(self.y_train.max()) + 1
        return nn.Sequential(nn.Linear(d_in, self.hidden), nn.ReLU(), nn.Linear(self.hidden, self.hidden), nn.ReLU(),
                             nn.Linear(self.hidden, classes))

    def shard(self, index: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x_train[index::count], self.y_train[index::count]

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """(test loss, test accuracy in %)."""
        logits = model(self.x_test)
        loss = nn.functional.cross_entropy(logits, self.y_test).item()
        return loss, 100.0 * (logits.argmax(1) == self.y_test).float().mean().item()


def digits_task(seed: int = 0, hidden: int = 256) -> Task:
    """scikit-learn's digits (1,797 real 8x8 scans, shipped with the package): 80/20 split, standardized."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = data.data.astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    mean, std = x[:cut].mean(0), x[:cut].std(0) + 1e-6
    x = (x - mean) / std
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return Task("digits", t(x[:cut]), t(y[:cut]), t(x[cut:]), t(y[cut:]), hidden=hidden)
