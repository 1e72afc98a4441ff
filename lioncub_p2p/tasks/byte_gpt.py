"""A byte-level GPT trained on the Python standard library's own source files (on every machine,
nothing to download): next-byte prediction, vocabulary 256."""
from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .contract import IntArg, TrainingTask

DEFAULT_WIDTH = 128
CONTEXT, HEADS = 64, 4
# what a run's manifest (task_args) may set: 1024 wide is 25M parameters (~300 MB with Lion's momentum and the
# gradients), what a volunteer's laptop holds beside its other work; the width is split among the heads
ARGS = {"hidden": IntArg(8, 1024, multiple=HEADS, multiple_of=f"its {HEADS} attention heads")}


class ByteGPT(nn.Module):
    """A small decoder-only transformer over bytes (vocabulary 256)."""

    def __init__(self, context: int = CONTEXT, width: int = DEFAULT_WIDTH, layers: int = 2, heads: int = HEADS):
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
    """Next-byte prediction on the standard library's sources: training and test bytes."""

    train: torch.Tensor
    test: torch.Tensor
    context: int = 64
    width: int = DEFAULT_WIDTH
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
        return loss, loss / math.log(2)


def stdlib_bytes_task(max_bytes: int = 2_000_000, context: int = 64, width: int = DEFAULT_WIDTH) -> ByteLMTask:
    """Bytes of the standard library's .py files, sorted by path (deterministic), 90/10 split."""
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


def byte_gpt(seed: int = 0, hidden: int | None = None) -> TrainingTask:
    """The built-in ``--task byte-gpt``: ByteGPT (``--hidden`` wide, 2 layers, 64-byte context).

    Every peer reads the same bytes (sorted paths), so peers of one Python version share a corpus;
    ``--batch`` counts windows of 64 bytes. Evaluation: test loss (nats/byte) and bits per byte."""
    width = hidden or DEFAULT_WIDTH  # checked against ARGS by load_task
    data = stdlib_bytes_task(width=width)

    def evaluate(model: nn.Module) -> dict[str, float]:
        loss, bits = data.evaluate(model)
        return {"loss": loss, "bits_per_byte": bits}

    return TrainingTask(model=data.make_model(seed), data=lambda batch, gen: data.sample(0, 1, batch, gen),
                        loss=lambda model, batch: data.loss(model, *batch), evaluate=evaluate, name="byte-gpt")


def param_count(hidden: int | None = None, layers: int = 2) -> int:
    """The built-in model's parameter count, written out (tests check it against a build): nothing is
    allocated, and no transformer is built on the meta device, which imports torch._dynamo (~1.5 s)."""
    w = hidden or DEFAULT_WIDTH
    per_layer = 12 * w * w + 13 * w  # attention in/out projections, the 4w feed-forward, two layer norms
    return layers * per_layer + 256 * w + CONTEXT * w + 2 * w + 256 * w + 256  # embeddings, norm, head
