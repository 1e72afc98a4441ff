"""ClusterAggregator: LionCub's vote over ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

The butterfly of ``allreduce/`` with collectives instead of streams, so a multi-GPU box or a
cluster trains with the same codecs and gets the same bytes:

1. rank r reduces part r of the flat vote buffer: ``partition.part_bounds`` over ranks of equal
   weight, so every part boundary is the one a group of as many peers would use;
2. all-to-all of packed code planes: every rank receives every rank's codes of its part;
3. every rank counts its part on packed words with the reducer's own code (``codecs.Tally``, the
   code a ``PartReduction`` runs) and encodes the result with the same result codec, seed and tie
   stream (the part's global byte offset);
4. all-gather of the encoded results (parts padded to the largest), then decoding as the butterfly
   assembles them (``allreduce.assemble``).

A collective either completes on every rank or fails the job, so there are no missing parts,
quorums, audits or signatures: ranks of one job trust each other. For the same votes and seed the
update is byte for byte the butterfly's (``tests/test_cluster.py`` compares with ``LocalSwarm``).

Momentum averaging runs on a ``MomentumSchedule`` through the same partitioned exchange:
``momentum_wire="fp32"`` (the default) sends exact float32 values and averages them in rank order,
the in-process reference's exact mean (``momentum.average_in_process``) bit for bit;
``momentum_wire="bf16"`` halves the bytes and reproduces a swarm's momentum round exactly (values
rounded to bfloat16, the mean or trimmed mean of the rows, rounded to bfloat16 again).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..allreduce import assemble
from ..allreduce.partition import PeerSpec, part_bounds
from ..allreduce.round import PartResult, RoundSpec, result_wire, upload_wire
from ..codecs import (AverageResult, Bf16Upload, MajorityResult, ResultCodec, Tally, UploadCodec, result_codec,
                      upload_codec)
from ..momentum import MomentumSchedule
from ..optim import LionCub
from .collectives import Collectives, as_collectives

MOMENTUM_WIRES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MOMENTUM_RULES = ("average", "trimmed_mean")
CLUSTER_ROUND_ID = b"cluster"


@dataclass
class ClusterStats:
    """Payload bytes this rank sent to other ranks in its last vote and momentum exchange (codes and
    results as the butterfly would send them, padding of the all-gather included; not the backend's
    transport bytes, which depend on its algorithms)."""

    vote_bytes: int = 0
    momentum_bytes: int = 0
    momentum_syncs: int = 0


class ClusterAggregator:
    """LionCub's ``Aggregator`` over the ranks of a ``torch.distributed`` process group.

    Args:
        process_group: the ranks that vote together (None: the default group), or ``Collectives``.
        upload: "sign", "l1" / "l1:BITS" (what every rank sends, as in a swarm).
        result: "majority", "ternary" or "mean" (what every rank applies).
        momentum: when to average the ranks' momenta (default: never).
        seed: keys the shared tie-break stream; equal on every rank (and to LionCub's seed).
        momentum_wire: "fp32" (exact mean) or "bf16" (half the bytes, a swarm's momentum round).
        momentum_rule: "average", or "trimmed_mean" as a swarm's default.
        check: before every exchange, all-gather the sizes, step and encodings and raise ValueError on
            every rank if they differ (a mismatched exchange would otherwise fail obscurely or hang).
    """

    def __init__(self, process_group=None, upload: str | UploadCodec = "sign", result: str | ResultCodec = "majority",
                 momentum: MomentumSchedule | None = None, seed: int = 0, *, momentum_wire: str = "fp32",
                 momentum_rule: str = "average", check: bool = True):
        self.upload = upload_codec(upload)
        if isinstance(self.upload, Bf16Upload):
            raise ValueError("a cluster vote needs upload 'sign' or 'l1:BITS'; bf16 is for momentum averaging")
        self.result = result_codec(result)
        if isinstance(self.result, AverageResult):
            raise ValueError(f"result {self.result.name!r} averages bf16 values; votes use 'majority', 'ternary' "
                             "or 'mean'")
        if momentum_wire not in MOMENTUM_WIRES:
            raise ValueError(f"momentum_wire must be one of {sorted(MOMENTUM_WIRES)}, got {momentum_wire!r}")
        if momentum_rule not in MOMENTUM_RULES:
            raise ValueError(f"momentum_rule must be one of {MOMENTUM_RULES}, got {momentum_rule!r}")
        self.comm: Collectives = as_collectives(process_group)
        self.momentum = momentum or MomentumSchedule.never()
        self.seed = int(seed)
        self.momentum_wire, self.momentum_rule = momentum_wire, momentum_rule
        self.check = check
        self.group = tuple(PeerSpec(f"rank{r}") for r in range(self.comm.size))
        self.stats = ClusterStats()
        self._names_checked = False

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    # -- the vote ---------------------------------------------------------------------------------

    def spec(self, nbytes: int, step: int) -> RoundSpec:
        """The butterfly round these ranks mirror (its bounds, sizes and codecs)."""
        return RoundSpec(CLUSTER_ROUND_ID, step, self.group, nbytes, self.upload, self.result, self.seed)

    def aggregate(self, upload: torch.Tensor, *, step: int) -> torch.Tensor:
        """Every rank's update for the flat buffer: packed uint8 (nbytes,) for majority, else float32
        (nbytes*8,); on ``upload``'s device."""
        planes = self.upload.planes
        if upload.dtype != torch.uint8 or upload.dim() != 2 or upload.shape[0] != planes:
            raise ValueError(f"upload must be uint8 of shape ({planes}, nbytes), got {upload.dtype} "
                             f"{tuple(upload.shape)}")
        nbytes, device = upload.shape[1], upload.device
        if self.check:
            up_kind, up_bits = upload_wire(self.upload)
            self._agree("vote", {"buffer bytes": nbytes, "step": step, "seed": self.seed % (1 << 62), "upload": up_kind,
                                 "upload bits": up_bits, "result": result_wire(self.result)}, device)
        spec = self.spec(nbytes, step)
        received, sent = self._exchange(upload.contiguous(), spec.bounds)
        start, stop = spec.bounds[self.rank]
        wire = self._reduce(received, start, stop, step)
        sizes = [spec.result_size(j, self.size) for j in range(self.size)]
        if wire.numel() != sizes[self.rank]:
            raise RuntimeError(f"part {self.rank} encoded {wire.numel()} bytes, expected {sizes[self.rank]}")
        results, gathered = self._gather(wire, sizes)
        self.stats.vote_bytes = sent + gathered
        if isinstance(self.result, MajorityResult):  # every part present: the packed parts joined in order
            return torch.cat(results) if results else torch.zeros(0, dtype=torch.uint8, device=device)
        outcomes = {j: PartResult(results[j].cpu().numpy().tobytes(), list(range(self.size)))
                    for j, (a, b) in enumerate(spec.bounds) if b > a}
        update, bad = assemble(spec, outcomes)
        if bad:  # the ranks' own encodings: only a bug gets here, and every rank sees the same bytes
            raise RuntimeError(f"cluster results did not decode: {bad}")
        return update.to(device)

    def _reduce(self, received: torch.Tensor, start: int, stop: int, step: int) -> torch.Tensor:
        """This rank's part: the reducer's tally of every rank's codes, encoded with the part's offset."""
        if stop == start:
            return torch.zeros(0, dtype=torch.uint8, device=received.device)
        tally = Tally(self.upload, stop - start, self.size, device=received.device)
        for voter in range(self.size):
            tally.add(received[voter], 0)
        return self.result.encode(tally.planes(), self.size * self.upload.max_code, 8 * (stop - start),
                                  seed=self.seed, step=step, offset=start).reshape(-1)

    # -- momentum averaging -----------------------------------------------------------------------

    def after_step(self, optimizer: LionCub) -> None:
        """Average the selected momenta over the ranks when the schedule says so (in place)."""
        step = optimizer.step_count
        if not self.momentum.due(step):
            return
        buffers = optimizer.momentum_buffers()
        if not self._names_checked:
            self.momentum.check_names(name for name, _ in buffers)
            self._names_checked = True
        selected = [m for name, m in buffers if self.momentum.selects(name)]
        flat = torch.cat([m.detach().reshape(-1).float() for m in selected])
        averaged = self.average(flat, step=step)
        offset = 0
        with torch.no_grad():
            for m in selected:
                m.copy_(averaged[offset : offset + m.numel()].view_as(m))
                offset += m.numel()
        self.stats.momentum_syncs += 1

    def average(self, values: torch.Tensor, *, step: int = 0) -> torch.Tensor:
        """The ranks' average of a 1-D float tensor (same numel on every rank), as float32, through
        the partitioned exchange in ``momentum_wire`` precision with ``momentum_rule``."""
        dtype = MOMENTUM_WIRES[self.momentum_wire]
        raw = values.detach().reshape(-1).to(dtype).contiguous().view(torch.uint8).unsqueeze(0)
        nbytes, device = raw.shape[1], raw.device
        if self.check:
            self._agree("momentum", {"momentum bytes": nbytes, "step": step}, device)
        bounds = part_bounds(nbytes, self.group)
        received, sent = self._exchange(raw, bounds)
        start, stop = bounds[self.rank]
        rows = received.reshape(self.size, stop - start).contiguous().view(dtype).float()
        rule = AverageResult(trimmed=self.momentum_rule == "trimmed_mean")
        mine = rule.aggregate(rows).to(dtype).view(torch.uint8) if stop > start else raw.new_zeros(0)
        parts, gathered = self._gather(mine, [b - a for a, b in bounds])
        self.stats.momentum_bytes = sent + gathered
        return torch.cat(parts).view(dtype).float()

    # -- the exchanges ----------------------------------------------------------------------------

    def _exchange(self, codes: torch.Tensor, bounds: list[tuple[int, int]]) -> tuple[torch.Tensor, int]:
        """All-to-all of (planes, nbytes) codes: every rank's planes of this rank's part, as
        (ranks, planes, part bytes), and the bytes this rank sent to the others."""
        planes = codes.shape[0]
        start, stop = bounds[self.rank]
        mine = stop - start
        pieces = [codes[:, a:b].reshape(-1) for a, b in bounds]
        out = torch.empty(self.size * planes * mine, dtype=torch.uint8, device=codes.device)
        self.comm.all_to_all(out, torch.cat(pieces), [planes * mine] * self.size, [p.numel() for p in pieces])
        sent = sum(p.numel() for j, p in enumerate(pieces) if j != self.rank)
        return out.view(self.size, planes, mine), sent

    def _gather(self, wire: torch.Tensor, sizes: list[int]) -> tuple[list[torch.Tensor], int]:
        """All-gather of every rank's encoded part (``sizes[r]`` bytes from rank r), padded to the
        largest, and the bytes this rank sent to the others."""
        width = max(sizes, default=0)
        if width == 0:
            return [wire.new_zeros(0) for _ in sizes], 0
        padded = wire.new_zeros(width)
        padded[: wire.numel()] = wire
        outs = [torch.empty_like(padded) for _ in sizes]
        self.comm.all_gather(outs, padded)
        return [out[:size] for out, size in zip(outs, sizes)], width * (self.size - 1)

    def _agree(self, what: str, fields: dict[str, int], device: torch.device) -> None:
        """Raise ValueError on every rank unless every rank passes the same ``fields``."""
        mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        self.comm.all_gather(everyone, mine)
        for k, name in enumerate(fields):
            values = [int(t[k]) for t in everyone]
            if len(set(values)) > 1:
                raise ValueError(f"cluster {what} exchange: ranks disagree on {name} ({values} by rank); every "
                                 "rank must train the same model with the same optimizer settings in step")
