"""LionCub: Lion whose per-step direction can be voted on by a group of peers.

Per parameter tensor θ with gradient g and momentum m (β1, β2, learning rate lr, weight decay λ):

    c = β1·m + (1 − β1)·g                      # Lion's direction
    u = aggregate(encode(c)) over the group    # u = sign(c) when training alone
    θ ← θ·(1 − lr·λ) − lr·u                    # decoupled weight decay, then the step
    m ← β2·m + (1 − β2)·g

Alone (``aggregator=None``) this is exactly Lion, sign(0) = 0 included. With an aggregator, every
peer packs its c into one flat buffer (``upload`` codec: 1-bit signs, or L1 p-bit codes), the
aggregator returns the group's update for the whole buffer, and every peer applies that same update,
so replicas that start equal stay equal. For 1-bit signs, direction + packing + momentum update of
all parameters is one pass over memory in one kernel call, and so is unpacking + applying
(``ops.LionKernels``); L1 codes are computed tensor by tensor.

The flat buffer lays parameters out in ``param_groups`` order, each starting on a byte boundary:
parameter i owns bytes [offset_i, offset_i + ceil(numel_i / 8)) of every code plane, i.e. vote
positions 8·offset_i .. 8·offset_i + numel_i − 1. Parameters without a gradient vote with g = 0 so the
layout never depends on which gradients a peer happened to compute.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import numpy as np
import torch

from . import ops
from .codecs import SignUpload, UploadCodec, upload_codec
from .ops import torch_impl
from .ops.randbits import derive_key


class Aggregator(Protocol):
    """The seam between the optimizer and the network (or an in-process group).

    ``aggregate`` receives this peer's upload codes, (planes, nbytes) uint8 for the whole flat buffer,
    and returns the update every peer applies: packed uint8 (nbytes,) for a 1-bit result, or float32
    (nbytes*8,) values in [−1, 1] for ternary and mean results; or None when it replaced this peer's
    state (parameters, momenta, step) instead, e.g. after repairing a divergence.

    An aggregator may also define ``before_step()``, called before the step touches any state (a
    swarm holds off snapshots from there), and ``after_step(optimizer)``, called once the update is
    applied (the place for momentum averaging, snapshots for other peers, checkpoints).

    An aggregator with ``delay = 1`` overlaps its rounds with compute: the optimizer calls
    ``submit(upload, step=t)``, which starts round t and returns at once, then waits for round t − 1
    and applies its update; see ``LionCub``."""

    upload: UploadCodec

    def aggregate(self, upload: torch.Tensor, *, step: int) -> torch.Tensor | None: ...


class PendingUpdate(Protocol):
    """A round in flight (``Aggregator.submit``).

    ``wait()``: the update to apply (as ``aggregate`` returns it; None when the aggregator replaced the
    optimizer's state meanwhile). ``peek(timeout)``: the same update without acting on the round (no
    repair, no bookkeeping; None if there is nothing to apply), for a snapshot taken between steps from
    another thread. ``done()``: whether ``peek`` would return at once."""

    def wait(self) -> torch.Tensor | None: ...

    def peek(self, timeout: float) -> torch.Tensor | None: ...

    def done(self) -> bool: ...


class TrainingView(Protocol):
    """What an aggregator's round machinery reads of the optimizer (``LionCub`` is one): the swarm's vote
    pipeline sees nothing else (``tests/test_imports.py`` checks it). The whole state as bytes (joining,
    repair, the state tag) is ``swarm/snapshot.py``'s, the one module that knows LionCub's layout."""

    @property
    def step_count(self) -> int: ...

    @property
    def buffer_bytes(self) -> int: ...

    @property
    def param_count(self) -> int: ...

    @property
    def in_flight(self) -> "PendingUpdate | None": ...

    def momentum_buffers(self) -> list[tuple[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class Resolved:
    """An update already known: restored from a snapshot with the round that produced it, or a round
    decided without running (zeros for a missed one; None when it replaced the state instead)."""

    update: torch.Tensor | None

    def wait(self) -> torch.Tensor | None:
        return self.update

    def peek(self, timeout: float) -> torch.Tensor | None:
        return self.update

    def done(self) -> bool:
        return True


def _without_dynamo_guard(name: str) -> Callable:
    """``torch.optim.Optimizer``'s method ``name`` without the wrapper that keeps torch.compile out of it.

    The wrapper imports ``torch._dynamo`` at its first call: 1.5-2 s of CPU in every trainer process
    (measured), longer than the rest of a peer's start. LionCub's step waits on the network and is
    never compiled, so the guard buys nothing here. Only torch's own guard is taken off (another
    decorator, or a torch without the guard, keeps the method as it is)."""
    method = getattr(torch.optim.Optimizer, name)
    guard = getattr(getattr(method, "__code__", None), "co_qualname", "")
    return method.__wrapped__ if guard.startswith("_disable_dynamo.") and hasattr(method, "__wrapped__") else method


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the flat vote buffer."""

    param: torch.Tensor
    group: dict
    name: str
    offset: int  # first byte
    nbytes: int


class LionCub(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) with a pluggable vote over peers (Lion Cub, Ishikawa et al. 2024).

    Args:
        params: parameters, named parameters (``model.named_parameters()``) or param groups.
        lr: step size; Lion wants 3–10× less than AdamW.
        betas: (β1 for the direction, β2 for the momentum).
        weight_decay: decoupled decay λ; Lion wants 3–10× more than AdamW.
        aggregator: where directions are voted on; ``None`` trains alone as plain Lion.
        upload: "sign" (1 bit), "l1" / "l1:BITS" or a codec; ignored when the aggregator names one.
        seed: keys the shared pseudo-random bits that replace sign(0); identical on every peer, and
            inverted every second step, so a direction that is 0 on every peer nets no movement.
        lr_schedule: multiplier of every group's lr as a function of the optimizer's step, which in a
            swarm is the swarm's global step: a peer that joins late follows the same schedule.

    Overlapped rounds (an aggregator with ``delay = 1``, e.g. ``SwarmConfig(delay=1)``): step t
    computes c_t from the gradient at θ, starts the vote on it, then waits for the vote of step t − 1
    (which travelled while this step's forward/backward ran) and applies that update:

        θ ← θ·(1 − lr·λ) − lr·u_{t−1}      (nothing at the first step)

    so the gradient of step t is taken at parameters one update behind. Every peer still applies the
    same updates in the same order, and between steps ``step_count`` counts the votes started; the
    one in flight is part of the state (``in_flight_update``, snapshots and checkpoints carry it).
    ``flush()`` applies it without starting another (e.g. before evaluating the final model).
    """

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, aggregator: Aggregator | None = None,
                 upload: str | UploadCodec = "sign", seed: int = 0,
                 lr_schedule: Callable[[int], float] | None = None):
        if not lr > 0.0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"betas must be two values in [0, 1), got {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, step=0))
        self.aggregator = aggregator
        self.upload_codec = aggregator.upload if aggregator is not None else upload_codec(upload)
        self.seed = seed
        self.lr_schedule = lr_schedule
        self._slots: list[Slot] | None = None
        self._kernels: ops.LionKernels | None = None
        self._group_index = np.zeros(0, dtype=np.int64)  # param_groups index of every slot
        self._in_flight: PendingUpdate | None = None  # the vote of the last step (overlapped rounds)
        self._generation = 0  # bumped whenever the state is replaced (a download), also mid-step

    # -- layout ---------------------------------------------------------------------------------

    @property
    def slots(self) -> list[Slot]:
        if self._slots is None:
            slots, offset, group_index = [], 0, []
            for gi, group in enumerate(self.param_groups):
                names = group.get("param_names") or [f"group{gi}.param{i}" for i in range(len(group["params"]))]
                for name, p in zip(names, group["params"]):
                    slots.append(Slot(p, group, name, offset, ops.packed_size(p.numel())))
                    offset += slots[-1].nbytes
                    group_index.append(gi)
            self._slots = slots
            self._group_index = np.array(group_index, dtype=np.int64)
            self._kernels = None
        return self._slots

    @property
    def buffer_bytes(self) -> int:
        """Bytes per code plane of the flat vote buffer."""
        last = self.slots[-1]
        return last.offset + last.nbytes

    @property
    def param_count(self) -> int:
        """Parameters voted on (every element of every slot)."""
        return sum(s.param.numel() for s in self.slots)

    @property
    def step_count(self) -> int:
        """Completed optimizer steps (the swarm's global step once it joins one)."""
        return self.param_groups[0]["step"]

    zero_grad = _without_dynamo_guard("zero_grad")
    state_dict = _without_dynamo_guard("state_dict")
    _base_add_param_group = _without_dynamo_guard("add_param_group")
    _base_load_state_dict = _without_dynamo_guard("load_state_dict")

    def add_param_group(self, param_group: dict) -> None:
        self._base_add_param_group(param_group)
        self._slots = None
        self._kernels = None

    def _momentum(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return state["exp_avg"]

    def momentum_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """(name, momentum) for every parameter, created if missing: what momentum averaging syncs.

        Update them in place (``copy_``): the fused kernels hold on to these tensors until
        ``load_state_dict`` or ``add_param_group`` lays the buffer out again."""
        return [(slot.name, self._momentum(slot.param)) for slot in self.slots]

    def _fused(self) -> ops.LionKernels:
        """The kernels that pack and apply all parameters in one call each (built on first use)."""
        slots = self.slots
        if self._kernels is None:
            self._kernels = ops.LionKernels([s.param for s in slots], [self._momentum(s.param) for s in slots],
                                            [s.offset for s in slots], self._group_index)
        return self._kernels

    # -- stepping ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.aggregator is None:
            self._lion_step()
            return loss
        before_step = getattr(self.aggregator, "before_step", None)
        if before_step is not None:
            before_step()
        if getattr(self.aggregator, "delay", 0):
            self._overlapped_step()
        else:
            self.flush()  # a vote in flight restored from an overlapped run's state: applied first
            update = self.aggregator.aggregate(self.compute_upload(), step=self.step_count)
            if update is not None:
                self.apply_aggregate(update)
        after_step = getattr(self.aggregator, "after_step", None)
        if after_step is not None:
            after_step(self)
        return loss

    def _overlapped_step(self) -> None:
        generation = self._generation
        pending = self.aggregator.submit(self.compute_upload(), step=self.step_count)
        if self._generation != generation:  # submitting replaced the state (rejoined): the donor's round is ours
            return
        previous, self._in_flight = self._in_flight, pending
        if previous is not None:
            update = previous.wait()
            if self._generation != generation:  # repaired from a peer while waiting: its state, its round
                return
            if update is not None:
                self._apply(update)
        self._advance()

    @torch.no_grad()
    def flush(self) -> None:
        """Apply the update of the round in flight, if any, and start none (overlapped rounds): e.g.
        when a run is over, before evaluating or saving the model for use."""
        exclusive = getattr(self.aggregator, "exclusive", None)
        with exclusive() if exclusive is not None else contextlib.nullcontext():
            while self._in_flight is not None:
                generation = self._generation
                update = self._in_flight.wait()
                if self._generation != generation:  # repaired while waiting: the donor's state and its round
                    continue  # in flight (if any) replaced ours: flush that one
                if update is not None:
                    self._apply(update)
                self._in_flight = None

    def in_flight_update(self, timeout: float = 120.0) -> torch.Tensor | None:
        """The update of the round in flight (waiting up to ``timeout`` for it), or None if there is none."""
        return None if self._in_flight is None else self._in_flight.peek(timeout)

    @property
    def in_flight(self) -> PendingUpdate | None:
        """The round in flight (overlapped rounds), if any."""
        return self._in_flight

    def restore_in_flight(self, update: torch.Tensor | None) -> None:
        """After loading a state: the in-flight round's update that came with it (None: no round in flight)."""
        self._in_flight = None if update is None else Resolved(update)
        self._generation += 1

    def lr(self, group: dict) -> float:
        """The group's step size at the current step (``lr_schedule`` applied)."""
        return group["lr"] * (self.lr_schedule(self.step_count) if self.lr_schedule else 1.0)

    def _lion_step(self) -> None:
        """Plain Lion, written out: the single-peer case needs sign(0) = 0 exactly."""
        for slot in self.slots:
            p, group = slot.param, slot.group
            if p.grad is None:
                continue
            beta1, beta2 = group["betas"]
            m = self._momentum(p)
            c = m.mul(beta1).add_(p.grad, alpha=1 - beta1)
            lr = self.lr(group)
            if group["weight_decay"]:
                p.mul_(1 - lr * group["weight_decay"])
            p.add_(c.sign_(), alpha=-lr)
            m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        self._advance()

    def _direction_seed(self, index: int) -> int:
        return derive_key(self.seed, self.step_count, index)

    @torch.no_grad()
    def compute_upload(self) -> torch.Tensor:
        """This peer's codes for the flat buffer, (planes, buffer_bytes) uint8; updates momenta.

        Call ``apply_aggregate`` with the group's update before the next ``compute_upload``."""
        codec = self.upload_codec
        slots = self.slots
        device = slots[0].param.device
        if isinstance(codec, SignUpload):  # every byte belongs to one slot, so every byte gets written
            upload = torch.empty((1, self.buffer_bytes), dtype=torch.uint8, device=device)
            kernels = self._fused()
            kernels.direction_pack([p.grad for p in kernels.params], [group["betas"] for group in self.param_groups],
                                   ops.step_zero_keys(self.seed, self.step_count, len(slots)), upload[0])
            return upload
        upload = torch.zeros((codec.planes, self.buffer_bytes), dtype=torch.uint8, device=device)
        for index, slot in enumerate(slots):
            p, (beta1, beta2) = slot.param, slot.group["betas"]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            m = self._momentum(p)
            c = m.float().mul(beta1).add_(grad.float(), alpha=1 - beta1)
            upload[:, slot.offset : slot.offset + slot.nbytes] = codec.encode(
                c, seed=self._direction_seed(index)).to(upload.device)
            m.mul_(beta2).add_(grad, alpha=1 - beta2)
        return upload

    @torch.no_grad()
    def apply_aggregate(self, update: torch.Tensor) -> None:
        """Apply the group's update for the flat buffer (see ``Aggregator``) and count the step."""
        self._apply(update)
        self._advance()

    def check_update(self, update: torch.Tensor) -> None:
        """Raise ValueError unless ``update`` has the form ``Aggregator`` describes for this buffer."""
        packed = update.dtype == torch.uint8
        expected = self.buffer_bytes if packed else self.buffer_bytes * 8
        if update.dim() != 1 or update.numel() != expected:
            raise ValueError(f"update has shape {tuple(update.shape)}; expected ({expected},) "
                             f"{'packed bytes' if packed else 'float values'} for this optimizer's parameters")

    def _apply(self, update: torch.Tensor) -> None:
        self.check_update(update)
        if update.dtype != torch.uint8:
            update = update.to(torch.float32)
        groups = self.param_groups
        self._fused().apply(update, [self.lr(g) for g in groups], [g["weight_decay"] for g in groups])

    def _advance(self) -> None:
        for group in self.param_groups:
            group["step"] += 1

    def load_state_dict(self, state_dict: dict) -> None:
        self._base_load_state_dict(state_dict)
        self._slots = None
        self._kernels = None
        self._in_flight = None
        self._generation += 1


@torch.no_grad()
def reference_upload(optimizer: LionCub) -> torch.Tensor:
    """``compute_upload`` for the sign codec as it was before the fused kernels: tensor by tensor on
    the torch path. The bytes (and momenta) the fused path must reproduce; kept for tests and
    ``benchmarks/kernels.py``."""
    upload = torch.zeros((1, optimizer.buffer_bytes), dtype=torch.uint8, device=optimizer.slots[0].param.device)
    for index, slot in enumerate(optimizer.slots):
        p, (beta1, beta2) = slot.param, slot.group["betas"]
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        step = optimizer.step_count  # pairs of steps share a stream, the odd one inverted (ops.step_zero_keys)
        key = ops.zero_sign_key(derive_key(optimizer.seed, step // 2, index)) | ((step & 1) << 32)
        bits = torch_impl.lion_direction_pack(grad, optimizer._momentum(p), beta1, beta2, key)
        upload[0, slot.offset : slot.offset + slot.nbytes] = bits.to(upload.device)
    return upload


@torch.no_grad()
def reference_apply(optimizer: LionCub, update: torch.Tensor) -> None:
    """``apply_aggregate`` as it was before the fused kernels (tensor by tensor, torch path)."""
    for slot in optimizer.slots:
        p, group = slot.param, slot.group
        if update.dtype == torch.uint8:
            u = update[slot.offset : slot.offset + slot.nbytes]
        else:
            u = update[8 * slot.offset : 8 * slot.offset + p.numel()].to(torch.float32)
        torch_impl.apply_update(p, u.to(p.device), optimizer.lr(group), group["weight_decay"])
    optimizer._advance()
