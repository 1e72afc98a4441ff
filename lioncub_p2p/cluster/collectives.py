"""The three collectives the cluster path needs, over a ``torch.distributed`` process group.

A seam of its own so the aggregators read as the butterfly they mirror (exchange parts, reduce,
gather results) and so tests can run several ranks as threads of one process.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class Collectives(Protocol):
    """Blocking collectives over a fixed group of ``size`` ranks; this process is ``rank``."""

    rank: int
    size: int

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        """1-D ``inp`` split by ``in_splits`` (one piece per rank, in rank order) is scattered; ``out``
        receives every rank's piece for this rank, in rank order, sized by ``out_splits``."""

    def all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """``outs[r]`` receives rank r's ``tensor`` (equal shapes on every rank)."""

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Every rank's ``tensor`` receives rank ``src``'s (``src`` is a rank of this group)."""


class TorchCollectives:
    """``Collectives`` over a ``torch.distributed`` process group (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group "
                               "(backend 'gloo' on CPU, 'nccl' on GPUs) before building a cluster aggregator")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)

    def all_gather(self, outs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        dist.all_gather(outs, tensor, group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        dist.broadcast(tensor, group=self.group, group_src=src)


def as_collectives(group: "dist.ProcessGroup | Collectives | None") -> Collectives:
    """A process group (or None for the default one) as ``Collectives``; ``Collectives`` as they are."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return TorchCollectives(group)
    if all(hasattr(group, name) for name in ("rank", "size", "all_to_all", "all_gather", "broadcast")):
        return group  # type: ignore[return-value]
    raise TypeError(f"expected a torch.distributed ProcessGroup, None or Collectives, got {type(group).__name__}")
