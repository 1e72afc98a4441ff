"""Experimental changes of the 1-bit vote (issue 15 §3), in process only: what would close the gap
to global Lion without more bits per step. Nothing here runs in a swarm; a variant that proves
itself is described for the codecs and the optimizer to ship (docs/quality.md).

A second implementation of the vote: one model (replicas that apply the same update stay equal),
per-worker momenta, directions encoded per tensor with the real upload codec and seeds, tallied and
decoded with the real result codec. Without options it reproduces ``inprocess.run_method``'s
replicas bit for bit (``tests/test_quality.py``), so a variant's effect is the variant's alone.

Options (``+NAME`` in a method spec, e.g. ``sign/majority+ef+tieprev``):

=============  ==================================================================  ============
option         what changes                                                          extra bits
=============  ==================================================================  ============
``ef``         error feedback of the compression: vote on v = c + e, keep            none
               e ← v − mean|v|·sign(v) (per tensor): what the 1-bit code dropped
``efvote``     error feedback of what the *vote* discarded: e ← v − mean|v|·u        none
               (u: the group's result), so a peer outvoted keeps pushing
``efdecayD``   with ``ef``/``efvote``: e is multiplied by D each step (e.g. 0.9)     none
``weighted``   votes weighted by each peer's per-tensor confidence mean|c|:           32 per tensor
               u = sign(Σ wᵢ·sign(cᵢ)); ties broken at random
``tieprev``    even-n ties take the previous step's result instead of a random bit   none
``tieemaB``    even-n ties take the sign of an EMA (β = B) of the past results        none
               (``tieprev`` is ``tieema0``); where it is 0, a random bit
``agree``      per tensor, the step is scaled by the vote's agreement                  ~16 per tensor
               mean|2T − total|/total, normalized to mean 1 over tensors
``betaB``      the vote's direction uses β1 = B (e.g. beta0.95); momentum unchanged  none
``abstainK``   on 1/K of the elements (rotating each step) a second bit lets a peer   1/K up
               abstain where |c| < mean|c| of its tensor (an l1:2 vote there); the
               sum of ±1/0 votes decides, ties at random
``delayD``     the vote of step t is applied at the end of step t + D (pipelined     none
               rounds: it travels while the next D forward/backward passes run on
               parameters without it); weight decay still every step
``groupsG``    two-level vote, majority of group majorities: groups of G             1 per group
               consecutive workers vote, the groups' majorities vote (issue 16;      (2nd level)
               exact counts combined are the flat vote itself, ``hierarchy.py``)
=============  ==================================================================  ============
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .. import ops
from ..allreduce.hierarchy import majority_of_majorities
from ..codecs import UploadCodec, reduce_votes, result_codec, upload_codec
from ..ops.randbits import derive_key
from .compare_tasks import CompareTask, DataExhausted
from .workers import Clock, Method, MomentumSyncs, Outcome, momentum_wire_bits, worker_loss

FLAGS = ("ef", "efvote", "weighted", "tieprev", "agree")
NUMBERED = ("efdecay", "beta", "abstain", "tieema", "delay", "groups")


def check_variant(name: str, spec: str = "") -> None:
    """ValueError with one line if ``name`` is no variant."""
    if name in FLAGS:
        return
    for prefix in NUMBERED:
        if name.startswith(prefix):
            try:
                float(name[len(prefix):])
                return
            except ValueError:
                break
    raise ValueError(f"method {spec!r}: unknown option {name!r}; options: syncK, geoR, untilT, bf16, bf16mean, lrX, "
                     f"{', '.join(FLAGS)}, {', '.join(p + 'N' for p in NUMBERED)}")


@dataclass(frozen=True)
class Options:
    ef: str | None = None  # "ef" or "efvote"
    ef_decay: float = 1.0
    weighted: bool = False
    tie_previous: bool = False
    tie_ema: float = 0.0  # with tie_previous: ties follow sign(EMA of results) with this β
    agree: bool = False
    beta1: float | None = None
    abstain: int = 0
    delay: int = 0
    groups: int = 0  # majority of the majorities of groups of this many workers (0: the flat vote)

    @classmethod
    def of(cls, names: Sequence[str]) -> "Options":
        values: dict = {}
        for name in names:
            check_variant(name)
            if name in ("ef", "efvote"):
                values["ef"] = name
            elif name == "weighted":
                values["weighted"] = True
            elif name == "tieprev":
                values["tie_previous"] = True
            elif name.startswith("tieema"):
                values["tie_previous"], values["tie_ema"] = True, float(name[6:])
            elif name == "agree":
                values["agree"] = True
            elif name.startswith("efdecay"):
                values["ef_decay"] = float(name[7:])
            elif name.startswith("beta"):
                values["beta1"] = float(name[4:])
            elif name.startswith("abstain"):
                values["abstain"] = int(float(name[7:]))
            elif name.startswith("delay"):
                values["delay"] = int(float(name[5:]))
            elif name.startswith("groups"):
                values["groups"] = int(float(name[6:]))
        return cls(**values)


class Layout:
    """Where each parameter lives in the flat vote buffer: the optimizer's layout (``LionCub.slots``)."""

    def __init__(self, params: list[nn.Parameter]):
        self.offsets, offset = [], 0
        for p in params:
            self.offsets.append(offset)
            offset += ops.packed_size(p.numel())
        self.nbytes = offset
        self.numels = [p.numel() for p in params]

    def pack(self, codec: UploadCodec, directions: list[torch.Tensor], seed: int, step: int) -> torch.Tensor:
        upload = torch.zeros((codec.planes, self.nbytes), dtype=torch.uint8)
        for index, (c, offset) in enumerate(zip(directions, self.offsets)):
            codes = codec.encode(c, seed=derive_key(seed, step, index))
            upload[:, offset : offset + codes.shape[1]] = codes
        return upload

    def split(self, update: torch.Tensor) -> list[torch.Tensor]:
        """The decoded result per parameter: packed bytes (1-bit results) or float values."""
        if update.dtype == torch.uint8:
            return [update[o : o + ops.packed_size(n)] for o, n in zip(self.offsets, self.numels)]
        return [update[8 * o : 8 * o + n] for o, n in zip(self.offsets, self.numels)]


def _signs(u: torch.Tensor, numel: int) -> torch.Tensor:
    return ops.unpack_signs(u, numel) if u.dtype == torch.uint8 else u


def run_variant(method: Method, task: CompareTask, *, workers: int, steps: int, batch: int, lr: float,
                weight_decay: float, seed: int, eval_at: Sequence[int] = (),
                betas: tuple[float, float] = (0.9, 0.99)) -> Outcome:
    """``method`` (a vote with ``method.variant`` options) on ``workers`` simulated peers."""
    opt = Options.of(method.variant)
    start = time.perf_counter()
    gens = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(workers)]
    model = task.make_model(seed)
    sources = task.batches(workers, batch, gens)
    params = [p for p in model.parameters()]
    names = [name for name, _ in model.named_parameters()]
    layout = Layout(params)
    up, res = upload_codec(method.upload), result_codec(method.result)
    if (opt.weighted or opt.abstain or opt.groups) and (up.planes != 1 or res.name != "majority"):
        raise ValueError(f"method {method.name!r}: weighted, abstain and group votes take sign uploads, majority "
                         f"results")
    beta1, beta2 = betas
    vote_beta1 = opt.beta1 if opt.beta1 is not None else beta1
    momenta = [[torch.zeros_like(p) for p in params] for _ in range(workers)]
    errors = [[torch.zeros_like(p) for p in params] for _ in range(workers)] if opt.ef else None
    previous: list[torch.Tensor | None] = [None] * len(params)
    numel = sum(layout.numels)
    curve, evals, clock, side_up, side_down = [], [], Clock(), 0.0, 0.0
    syncs = MomentumSyncs(method.momentum, method.momentum_rule)
    in_flight: list[tuple[list[torch.Tensor], list[float]]] = []  # votes not applied yet (delayD)
    wanted = {k for k in eval_at if 0 < k < steps}
    for step in range(steps):
        directions, losses = [], []
        try:
            for i, src in enumerate(sources):
                for p in params:
                    p.grad = None
                losses.append(worker_loss(task, model, src, clock))
                c_i = []
                for p, m in zip(params, momenta[i]):
                    g = p.grad if p.grad is not None else torch.zeros_like(p)
                    c_i.append(torch.mul(m, vote_beta1).add_(g, alpha=1 - vote_beta1))
                    m.mul_(beta2).add_(g, alpha=1 - beta2)
                if errors is not None:
                    c_i = [c + e * opt.ef_decay for c, e in zip(c_i, errors[i])]
                directions.append(c_i)
        except DataExhausted:
            break
        curve.append((step, sum(losses) / len(losses)))
        if opt.weighted:
            updates = _weighted_vote(directions, seed, step)
            side_up += 32.0 * len(params) / numel  # each peer's weight per tensor, fp32
        elif opt.abstain:
            updates = _abstain_vote(directions, seed, step, opt.abstain)
            side_up += 1.0 / opt.abstain
        else:
            uploads = [layout.pack(up, d, seed, step) for d in directions]
            if opt.groups:  # the groups' packed majorities, then their majority (ties as a flat vote's)
                wire = majority_of_majorities(torch.stack([
                    reduce_votes(uploads[g:g + opt.groups], up, res, numel=layout.nbytes * 8, seed=seed, step=step)
                    for g in range(0, workers, opt.groups)]), seed=seed, step=step)
            else:
                wire = reduce_votes(uploads, up, res, numel=layout.nbytes * 8, seed=seed, step=step)
            update = res.decode(wire, layout.nbytes * 8, workers * up.max_code)
            updates = [_signs(u, n) for u, n in zip(layout.split(update), layout.numels)]
        if opt.tie_previous and workers % 2 == 0 and up.planes == 1:
            updates = _ties_to_previous(updates, directions, previous)
        previous = [u.reshape(-1).clone() if prev is None or not opt.tie_ema
                    else prev.mul_(opt.tie_ema).add_(u.reshape(-1), alpha=1 - opt.tie_ema)
                    for u, prev in zip(updates, previous)]
        if errors is not None:
            for i, d in enumerate(directions):
                for e, v, u in zip(errors[i], d, updates):
                    scale = v.abs().mean()
                    e.copy_(v - scale * (u.view_as(v) if opt.ef == "efvote" else torch.sign(v)))
        scales = [1.0] * len(params)
        if opt.agree:
            scales = _agreement_scales(updates, directions, layout.numels)
            side_down += 16.0 * len(params) / numel  # the reducer's scale per tensor, bf16
        in_flight.append((updates, scales))
        updates, scales = in_flight.pop(0) if len(in_flight) > opt.delay else (None, scales)
        with torch.no_grad():
            for k, (p, s) in enumerate(zip(params, scales)):
                if weight_decay:
                    p.mul_(1 - lr * weight_decay)
                if updates is not None:  # the first D steps of a delayed run have no vote back yet
                    p.add_(updates[k].view_as(p), alpha=-lr * s)
        syncs.after_step([list(zip(names, m)) for m in momenta], step + 1)
        if step + 1 in wanted:
            evals.append((step + 1, task.evaluate(model)))
    done = max(len(curve), 1)
    sync_bits = momentum_wire_bits(method.momentum) * syncs.synced / numel / done
    extra_up, extra_down = side_up / done, side_down / done
    bits = (up.bits_per_element + res.bits_per_element(workers * up.max_code) + 2 * sync_bits
            + extra_up + extra_down)
    final = task.evaluate(model)
    evals.append((len(curve), final))
    second = next((v for k, v in final.items() if k != "loss"), float("nan"))
    return Outcome(method.name, len(curve), workers, second, final.get("loss", float("nan")), bits, True,
                   time.perf_counter() - start, curve, task.train_loss(model), up.bits_per_element + sync_bits + extra_up,
                   lr, seed, evals, clock.median())


def _weighted_vote(directions: list[list[torch.Tensor]], seed: int, step: int) -> list[torch.Tensor]:
    """sign(Σᵢ wᵢ·sign(cᵢ)) per tensor with wᵢ = mean|cᵢ| of that tensor; exact ties at random."""
    out = []
    for index, per_worker in enumerate(zip(*directions)):
        total = sum(c.abs().mean() * torch.where(c > 0, 1.0, -1.0) for c in per_worker)
        tie = ops.unpack_signs(ops.pack_signs(torch.zeros(total.numel()), seed=derive_key(seed, step, index, 7)),
                               total.numel()).view_as(total)
        out.append(torch.where(total == 0, tie, torch.sign(total)))
    return out


def _abstain_vote(directions: list[list[torch.Tensor]], seed: int, step: int, every: int) -> list[torch.Tensor]:
    """sign(Σᵢ aᵢ·sign(cᵢ)) with aᵢ = 0 where element j has (j + step) % every == 0 and |cᵢ| is below
    the mean |cᵢ| of the tensor, else 1; exact ties at random."""
    out = []
    for index, per_worker in enumerate(zip(*directions)):
        flat = [c.reshape(-1) for c in per_worker]
        flagged = (torch.arange(flat[0].numel()) + step) % every == 0
        total = sum(torch.where(flagged & (c.abs() < c.abs().mean()), 0.0, torch.where(c > 0, 1.0, -1.0))
                    for c in flat)
        tie = ops.unpack_signs(ops.pack_signs(torch.zeros(total.numel()), seed=derive_key(seed, step, index, 8)),
                               total.numel())
        out.append(torch.where(total == 0, tie, torch.sign(total)).view_as(per_worker[0]))
    return out


def _ties_to_previous(updates: list[torch.Tensor], directions: list[list[torch.Tensor]],
                      previous: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Where the 1-bit votes split evenly, repeat the previous step's result (a tie is noise)."""
    out = []
    for u, per_worker, prev in zip(updates, zip(*directions), previous):
        if prev is None:
            out.append(u)
            continue
        ones = sum((c > 0).to(torch.int16) for c in per_worker)
        follow = torch.where(prev == 0, u.view(-1), torch.sign(prev.view(-1)))  # an EMA can be 0: keep the draw
        out.append(torch.where(2 * ones.view(-1) == len(per_worker), follow, u.view(-1)))
    return out


def _agreement_scales(updates: list[torch.Tensor], directions: list[list[torch.Tensor]],
                      numels: list[int]) -> list[float]:
    """Per tensor: mean |2·(votes for +) − n| / n, normalized to a parameter-weighted mean of 1."""
    raw = []
    for per_worker in zip(*directions):
        n = len(per_worker)
        ones = sum((c > 0).float() for c in per_worker)
        raw.append(float((2 * ones - n).abs().mean() / n))
    total = sum(numels)
    mean = sum(r * k for r, k in zip(raw, numels)) / total
    return [r / mean if mean > 0 else 1.0 for r in raw]


__all__ = ["FLAGS", "NUMBERED", "Options", "check_variant", "run_variant"]
