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


class ByteGPT(nn.Module):
    """A small decoder-only transformer over bytes (vocabulary 256)."""

    def __init__(self, context: int = 64, width: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.embed(idx) + self.position[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


@dataclass
class ByteLMTask:
    """Next-byte prediction on the Python standard library's own source files (on every machine)."""

    train: torch.Tensor
    test: torch.Tensor
    context: int = 64
    width: int = 128
    name: str = "stdlib-bytes"

    def make_model(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return ByteGPT(self.context, self.width)

    def sample(self, shard: int, shards: int, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows from the shard-th contiguous slice of the training bytes."""
        size = len(self.train) // shards
        start = torch.randint(shard * size, (shard + 1) * size - self.context - 1, (batch,), generator=gen)
        windows = torch.stack([self.train[s : s + self.context + 1] for s in start.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]

    @staticmethod
    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, windows: int = 64) -> tuple[float, float]:
        """(test loss in nats per byte, bits per byte)."""
        gen = torch.Generator().manual_seed(0)
        start = torch.randint(0, len(self.test) - self.context - 1, (windows,), generator=gen)
        w = torch.stack([self.test[s : s + self.context + 1] for s in start.tolist()]).long()
        loss = self.loss(model, w[:, :-1], w[:, 1:]).item()
        return loss, loss / float(np.log(2))


def stdlib_bytes_task(max_bytes: int = 2_000_000, context: int = 64, width: int = 128) -> ByteLMTask:
    """Bytes of the standard library's .py files, sorted by path (deterministic), 90/10 split."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    data = torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)
    cut = int(0.9 * len(data))
    return ByteLMTask(data[:cut].clone(), data[cut:].clone(), context, width)
