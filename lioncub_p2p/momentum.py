"""When and what to synchronize of the peers' local momenta.

Each peer of a Lion Cub group keeps its own momentum; votes only quantize the directions. As the
momenta drift apart, the vote drifts away from global Lion (whose momentum is the average), so
Lion Cub averages them now and then. Tuning guide:

* ``every=K``: a full-precision (bf16 on the wire) average every K steps costs 16/K bits per
  element per step on top of the 1-bit vote's ~2; K = 16..64 keeps it under the vote's own cost.
* ``until=T``: early training moves fastest and drifts most; stop syncing after step T.
* ``geometric=r`` (with ``start``): sync at steps start, start·r, start·r², ... dense early, sparse
  later, for runs whose length is unknown.
* ``slices=K``: streamed instead of periodic: every step averages one slice, 1/K of each selected
  tensor (elements [j·n/K, (j+1)·n/K) at step ≡ j+1 mod K), so every element is synced every K
  steps, as with ``every=K``, at the same bytes, but spread evenly: no step carries a whole-buffer
  round that every peer waits through (a 21 s stall every 25 steps at 10 Mbit/s for 5.45M
  parameters). Each slice's round runs in the background beside the next steps, and its average
  is applied once it ended, as a correction (``m += average - sent``): no step waits for it.
  Replaces ``every``/``geometric``.
* ``wire="fp8"``: momentum values travel as e4m3 codes sharing a power-of-two exponent per 7
  values, 64/7 ≈ 9.1 bits per value instead of bf16's 16, on both legs of the round: 43% fewer
  momentum bytes. Each value keeps 4 significant bits (``codecs.Fp8Upload``); measured as good as
  bf16 at equal steps (``docs/benchmarks.md``).
* ``params=("encoder.*", ...)``: only parameters whose names match (fnmatch patterns), e.g. the
  layers whose momenta drift most. The names are the model's own only when the optimizer was
  built from ``model.named_parameters()``; ``check_names`` refuses patterns that select nothing.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Iterable

import torch


MIN_GEOMETRIC, MAX_GEOMETRIC = 1.01, 1e6


@dataclass(frozen=True)
class MomentumSchedule:
    """Answers "sync momentum after step ``step``?" (steps count completed optimizer steps, from 1)."""

    every: int = 0
    until: int | None = None
    geometric: float | None = None
    start: int = 1
    params: tuple[str, ...] = field(default_factory=tuple)
    slices: int = 0
    wire: str = "bf16"  # or "fp8"

    def __post_init__(self) -> None:
        if self.wire not in ("bf16", "fp8"):
            raise ValueError(f"wire must be bf16 or fp8, got {self.wire!r}")
        if self.slices < 0:
            raise ValueError(f"slices must be >= 0, got {self.slices}")
        if self.slices and (self.every or self.geometric is not None):
            raise ValueError("slices (streamed averaging) replaces every and geometric: set one of them")
        if self.every < 0:
            raise ValueError(f"every must be >= 0, got {self.every}")
        # a ratio a hair above 1 never moves a float past 2 (s * r == s): ``due`` looped for ever, and a
        # manifest is anyone's in an open run
        if self.geometric is not None and not MIN_GEOMETRIC <= self.geometric <= MAX_GEOMETRIC:
            raise ValueError(f"geometric ratio must be in [{MIN_GEOMETRIC}, {MAX_GEOMETRIC:g}], got {self.geometric}")
        if self.start < 1:
            raise ValueError(f"start must be >= 1, got {self.start}")
        if self.until is not None and self.until < 0:
            raise ValueError(f"until must be >= 0, got {self.until}")
        object.__setattr__(self, "params", tuple(self.params))

    @classmethod
    def never(cls) -> "MomentumSchedule":
        return cls()

    def due(self, step: int) -> bool:
        if step < 1 or (self.until is not None and step > self.until):
            return False
        if self.slices:
            return True
        if self.every and step % self.every == 0:
            return True
        if self.geometric is None:
            return False
        s = float(self.start)  # at most log(2**53) / log(MIN_GEOMETRIC) ~ 3700 products
        while math.ceil(s - 1e-9) < step:
            s *= self.geometric
        return math.ceil(s - 1e-9) == step

    def selects(self, name: str) -> bool:
        return not self.params or any(fnmatch.fnmatchcase(name, pattern) for pattern in self.params)

    def check_names(self, names: Iterable[str]) -> list[str]:
        """The names among ``names`` (the optimizer's, as ``LionCub.momentum_buffers()`` lists them)
        that this schedule syncs; ValueError if ``params`` patterns select none of them, which would
        leave nothing to average."""
        names = list(names)
        selected = [name for name in names if self.selects(name)]
        if selected or not names:
            return selected
        hint = ""
        if all(name.startswith("group") and ".param" in name for name in names):
            hint = (" The optimizer has no parameter names (it was given model.parameters()): build it with "
                    "LionCub(model.named_parameters(), ...) so the patterns can match.")
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise ValueError(f"MomentumSchedule(params={list(self.params)}) selects none of the optimizer's "
                         f"{len(names)} parameters ({shown}).{hint}")

    def slice_of(self, step: int, numel: int) -> tuple[int, int]:
        """The elements [lo, hi) of a tensor of ``numel`` that the sync after ``step`` averages."""
        if not self.slices:
            return 0, numel
        j = (step - 1) % self.slices
        return j * numel // self.slices, (j + 1) * numel // self.slices

    def syncs_per_step(self, steps: int) -> float:
        """Whole-buffer syncs per step over the first ``steps`` steps (for bandwidth accounting)."""
        share = 1.0 / self.slices if self.slices else 1.0
        return share * sum(self.due(s) for s in range(1, steps + 1)) / max(steps, 1)


def average_in_process(momenta: list[list[tuple[str, torch.Tensor]]], schedule: MomentumSchedule,
                       step: int = 1) -> int:
    """Replace each selected momentum (its slice for ``step``, with ``slices``) by its exact mean over
    peers (in place); returns elements synced.

    ``momenta[i]`` is peer i's ``LionCub.momentum_buffers()``; all peers list the same names."""
    if momenta:
        schedule.check_names(name for name, _ in momenta[0])
    synced = 0
    for buffers in zip(*momenta):
        name = buffers[0][0]
        if any(other != name for other, _ in buffers):
            raise ValueError(f"peers disagree on parameter order at {name!r}")
        if not schedule.selects(name):
            continue
        lo, hi = schedule.slice_of(step, buffers[0][1].numel())
        mean = torch.stack([m.view(-1)[lo:hi].float() for _, m in buffers]).mean(0)
        for _, m in buffers:
            m.view(-1)[lo:hi] = mean
        synced += mean.numel()
    return synced
