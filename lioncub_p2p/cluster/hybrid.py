"""HybridAggregator: a volunteer with several GPUs (local ranks) takes part in a swarm as one peer.

Per step, on every local rank (``LionCub.step`` calls ``aggregate`` then ``after_step``):

1. local exact counts: the local ranks vote with the cluster path (``ClusterAggregator``: all-to-all
   of packed codes, counts on packed words, all-gather), result "majority": the sign of the local
   count, ties broken by the shared pseudo-random bit of (seed, step) at each position;
2. the leader (local rank 0) votes that packed sign in the swarm (``swarm.aggregate``): the box is
   one voter, whatever its number of GPUs;
3. the leader broadcasts the swarm's update to the local ranks, which all apply the same bytes, so
   the box's replicas stay equal to each other and to the swarm's.

When the swarm replaced the leader's state instead of returning an update (a repair after a
divergence), every rank skips the step's update and ``after_step`` broadcasts the leader's
parameters, momenta and step. Momentum: on the steps ``momentum`` is due (give it the run's
schedule), the ranks first average their momenta locally, the leader then runs the swarm's
``after_step`` (which averages the box's mean with the other peers'), and the leader's momenta go
to every rank. A failure of the leader's swarm calls is broadcast and raised on every rank, so no
rank waits alone in a collective.
"""
from __future__ import annotations

from typing import Any

import torch

from ..codecs import SignUpload, UploadCodec
from ..momentum import MomentumSchedule
from ..optim import Aggregator, LionCub
from .aggregator import ClusterAggregator
from .collectives import Collectives

LEADER = 0
_STATE, _PACKED, _FLOAT, _FAILED = 0, 1, 2, 3  # what the leader's swarm call gave, as broadcast


class HybridAggregator:
    """LionCub's ``Aggregator`` for the local ranks of one volunteer that votes in a swarm as one peer.

    Args:
        local_group: the box's ranks (a ``torch.distributed`` process group, None for the default
            one, or ``Collectives``); local rank 0 is the leader.
        swarm: on the leader, the aggregator of the swarm (a ``Swarm`` with upload "sign"); None on
            every other rank.
        upload: what the local ranks send each other ("sign" or "l1:BITS"); the swarm always gets
            1 bit per parameter (the sign of the local count).
        momentum: when to average momenta, locally and in the swarm (the run's schedule).
        seed: the run's seed (the swarm's tie stream and LionCub's zero signs use the same).
        momentum_wire: the local average's precision ("fp32" or "bf16", see ``ClusterAggregator``).
    """

    def __init__(self, local_group=None, swarm: Aggregator | None = None, *, upload: str | UploadCodec = "sign",
                 momentum: MomentumSchedule | None = None, seed: int = 0, momentum_wire: str = "fp32"):
        self.local = ClusterAggregator(local_group, upload=upload, result="majority", momentum=momentum, seed=seed,
                                       momentum_wire=momentum_wire)
        self.comm: Collectives = self.local.comm
        self.upload = self.local.upload
        if (swarm is not None) != (self.comm.rank == LEADER):
            raise ValueError(f"local rank {self.comm.rank}: pass swarm= on local rank {LEADER} (the leader) and on "
                             "no other rank")
        if swarm is not None and not isinstance(getattr(swarm, "upload", SignUpload()), SignUpload):
            raise ValueError(f"the swarm's upload is {swarm.upload.name!r}: a hybrid peer votes its local sign, so "
                             "the run must use upload 'sign'")
        self.swarm = swarm
        self.momentum = self.local.momentum
        self._replaced = False

    @property
    def leader(self) -> bool:
        return self.comm.rank == LEADER

    def join(self, optimizer: LionCub, **kwargs: Any) -> int:
        """Every rank: the leader joins the swarm (``swarm.join``, which may download the run's state),
        then every rank takes the leader's parameters, momenta and step. Returns the step."""
        status, error = _PACKED, None
        if self.leader and hasattr(self.swarm, "join"):
            optimizer.aggregator = self.swarm  # Swarm.join asks for an optimizer built with it
            try:
                self.swarm.join(optimizer, **kwargs)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                status, error = _FAILED, e
            finally:
                optimizer.aggregator = self
        self._agree_status(status, error, "joining the swarm", _device(optimizer))
        self.broadcast_state(optimizer)
        return optimizer.step_count

    # -- per step -----------------------------------------------------------------------------------

    def aggregate(self, upload: torch.Tensor, *, step: int) -> torch.Tensor | None:
        local = self.local.aggregate(upload, step=step)  # packed sign of the local count, on every rank
        device = upload.device
        update, error = None, None
        header = torch.zeros(2, dtype=torch.int64, device=device)
        if self.leader:
            try:
                update = self.swarm.aggregate(local.unsqueeze(0), step=step)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                error = e
            header[0] = _FAILED if error is not None else _STATE if update is None else \
                _PACKED if update.dtype == torch.uint8 else _FLOAT
            header[1] = 0 if update is None else update.numel()
        self.comm.broadcast(header, LEADER)
        kind, numel = int(header[0]), int(header[1])
        if kind == _FAILED:
            raise RuntimeError(f"step {step}: the swarm round failed on the leader"
                               + (f": {type(error).__name__}: {error}" if error is not None else ""))
        if kind == _STATE:
            self._replaced = True
            return None
        dtype = torch.uint8 if kind == _PACKED else torch.float32
        out = update.to(device=device, dtype=dtype).contiguous() if self.leader else \
            torch.empty(numel, dtype=dtype, device=device)
        self.comm.broadcast(out, LEADER)
        return out

    def after_step(self, optimizer: LionCub) -> None:
        device = _device(optimizer)
        if self._replaced:
            self._replaced = False
            self.broadcast_state(optimizer)
        due = self.momentum.due(optimizer.step_count)
        self.local.after_step(optimizer)  # the box's own average first: the leader brings the box's mean
        status, error = _PACKED, None
        if self.leader and hasattr(self.swarm, "after_step"):
            try:
                self.swarm.after_step(optimizer)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                status, error = _FAILED, e
        self._agree_status(status, error, "the swarm's after_step", device)
        if due:
            for _, m in optimizer.momentum_buffers():
                self.comm.broadcast(m.data, LEADER)

    # -- state ----------------------------------------------------------------------------------------

    def broadcast_state(self, optimizer: LionCub) -> None:
        """Every rank takes the leader's parameters, momenta and step."""
        step = torch.tensor([optimizer.step_count], dtype=torch.int64, device=_device(optimizer))
        self.comm.broadcast(step, LEADER)
        with torch.no_grad():
            for slot in optimizer.slots:
                self.comm.broadcast(slot.param.data, LEADER)
            for _, m in optimizer.momentum_buffers():
                self.comm.broadcast(m.data, LEADER)
        for group in optimizer.param_groups:
            group["step"] = int(step[0])

    def _agree_status(self, status: int, error: Exception | None, what: str, device: torch.device) -> None:
        flag = torch.tensor([status], dtype=torch.int64, device=device)
        self.comm.broadcast(flag, LEADER)
        if int(flag[0]) == _FAILED:
            detail = f": {type(error).__name__}: {error}" if error is not None else " (see the leader's log)"
            raise RuntimeError(f"{what} failed on the leader{detail}")


def _device(optimizer: LionCub) -> torch.device:
    return optimizer.slots[0].param.device
