"""The cluster path: ClusterAggregator's updates equal an independent numpy count of the same votes
and the butterfly's bytes; LionCub replicas over it stay equal and match the in-process reference;
HybridAggregator's local ranks apply the swarm's update.

Fast tests run the ranks as threads over an in-process ``Collectives`` (below); the slow ones run
real gloo ranks in spawned processes on 127.0.0.1 and a LocalSwarm butterfly for the same votes."""
from __future__ import annotations

import copy
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lioncub_p2p import ops
from lioncub_p2p.cluster import ClusterAggregator, HybridAggregator
from lioncub_p2p.codecs import SignUpload, pack_planes, reduce_votes, result_codec, upload_codec
from lioncub_p2p.momentum import MomentumSchedule, average_in_process
from lioncub_p2p.optim import LionCub

# ---------------------------------------------------------------------------------------------------
# Ranks as threads: the collectives' semantics over a shared board and a barrier (no torch.distributed)


class ThreadWorld:
    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.board: list = [None] * size
        self.calls = 0

    def ranks(self) -> list["ThreadCollectives"]:
        return [ThreadCollectives(self, r) for r in range(self.size)]


class ThreadCollectives:
    def __init__(self, world: ThreadWorld, rank: int):
        self.world, self.rank, self.size = world, rank, world.size

    def _post(self, item):
        self.world.board[self.rank] = item
        self.world.barrier.wait()
        items = list(self.world.board)
        if self.rank == 0:
            self.world.calls += 1
        self.world.barrier.wait()
        return items

    def all_to_all(self, out, inp, out_splits, in_splits):
        assert sum(in_splits) == inp.numel() and sum(out_splits) == out.numel()
        items = self._post((inp.clone(), list(in_splits)))
        pieces = []
        for data, splits in items:
            start = sum(splits[: self.rank])
            pieces.append(data[start : start + splits[self.rank]])
        got = torch.cat(pieces)
        assert [p.numel() for p in pieces] == list(out_splits), "split sizes disagree between ranks"
        out.copy_(got)

    def all_gather(self, outs, tensor):
        items = self._post(tensor.clone())
        for out, item in zip(outs, items):
            assert out.shape == item.shape, "all_gather shapes differ between ranks"
            out.copy_(item)

    def broadcast(self, tensor, src):
        items = self._post(tensor.clone())
        assert items[src].shape == tensor.shape, "broadcast shapes differ between ranks"
        tensor.copy_(items[src])


def run_threads(size: int, fn, timeout: float = 120.0) -> list:
    """fn(rank, collectives) on ``size`` threads; their return values, or the first exception raised."""
    world = ThreadWorld(size)
    results, errors = [None] * size, [None] * size

    def body(rank, comm):
        try:
            results[rank] = fn(rank, comm)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[rank] = e
            world.barrier.abort()

    threads = [threading.Thread(target=body, args=(r, c), daemon=True) for r, c in enumerate(world.ranks())]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is not None:
        raise first
    if any(errors):
        raise errors[0]
    return results


# ---------------------------------------------------------------------------------------------------
# The independent reference: counts in numpy


def numpy_codes(upload: torch.Tensor, max_code: int) -> np.ndarray:
    """(planes, nbytes) packed planes -> per-position codes (LSB-first bits), the invalid all-ones code
    clipped to max_code as the codecs' table says."""
    planes = upload.numpy()
    bits = np.unpackbits(planes, axis=1, bitorder="little").astype(np.int64)
    codes = sum(bits[j] << j for j in range(planes.shape[0]))
    return np.minimum(codes, max_code)


def numpy_update(uploads: list[torch.Tensor], upload: str, result: str, seed: int, step: int) -> torch.Tensor:
    codec = upload_codec(upload)
    n, nbytes = len(uploads), uploads[0].shape[1]
    tally = sum(numpy_codes(u, codec.max_code) for u in uploads)
    total = n * codec.max_code
    margin = 2 * tally - total
    if result == "mean":
        return torch.from_numpy((margin / total).astype(np.float32))
    if result == "ternary":
        return torch.from_numpy(np.sign(margin).astype(np.float32))
    ties = np.unpackbits(ops.random_tie_bits(seed, step, nbytes).numpy(), bitorder="little").astype(bool)
    bits = (margin > 0) | ((margin == 0) & ties)
    return torch.from_numpy(np.packbits(bits, bitorder="little"))


def random_uploads(n: int, nbytes: int, upload: str, seed: int) -> list[torch.Tensor]:
    """Votes with many ties and all-ones codes: l1 codes drawn over the whole code range (the invalid
    all-ones code included); sign bits from few distinct rows so counts land on n/2 often."""
    gen = torch.Generator().manual_seed(seed)
    codec = upload_codec(upload)
    if codec.planes == 1:
        base = torch.randint(0, 256, (2, nbytes), dtype=torch.uint8, generator=gen)
        return [base[i % 2].clone().unsqueeze(0) if i < 2 else
                torch.randint(0, 256, (1, nbytes), dtype=torch.uint8, generator=gen) for i in range(n)]
    return [pack_planes(torch.randint(0, 1 << codec.planes, (8 * nbytes,), generator=gen), codec.planes)
            for _ in range(n)]


CASES = [(n, up, res, nbytes) for n in (3, 4) for up in ("sign", "l1:4") for res in ("majority", "ternary", "mean")
         for nbytes in (5, 1001)]


@pytest.mark.parametrize("n,upload,result,nbytes", CASES)
def test_cluster_update_equals_numpy_count(n, upload, result, nbytes):
    """Every rank's update equals numpy's count of all votes (5 bytes: some ranks reduce nothing)."""
    seed, step = 7, 3
    uploads = random_uploads(n, nbytes, upload, seed=nbytes * 10 + n)

    def rank(r, comm):
        agg = ClusterAggregator(comm, upload=upload, result=result, seed=seed)
        return agg.aggregate(uploads[r], step=step)

    updates = run_threads(n, rank)
    expected = numpy_update(uploads, upload, result, seed, step)
    for r, update in enumerate(updates):
        assert update.dtype == expected.dtype, (r, update.dtype)
        assert torch.equal(update, expected), f"rank {r} differs from the numpy count"
    # the single-reducer code path (one part, offset 0) agrees too
    single = reduce_votes(uploads, upload_codec(upload), result_codec(result), numel=8 * nbytes, seed=seed, step=step)
    if result == "majority":
        assert torch.equal(single, updates[0])
    else:
        decoded = result_codec(result).decode(single, 8 * nbytes, n * upload_codec(upload).max_code)
        assert torch.equal(decoded, updates[0])


def test_ties_follow_the_shared_stream_at_global_positions():
    """With 2 ranks voting opposite bits everywhere, every position ties: the result is the tie
    stream of (seed, step) itself, part by part at the part's global offset."""
    nbytes = 4099
    a = torch.randint(0, 256, (1, nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    uploads = [a, ~a]

    def rank(r, comm):
        return ClusterAggregator(comm, seed=11).aggregate(uploads[r], step=5)

    for update in run_threads(2, rank):
        assert torch.equal(update, ops.random_tie_bits(11, 5, nbytes))


def test_ranks_that_disagree_on_the_buffer_all_raise_one_clear_error():
    def rank(r, comm):
        agg = ClusterAggregator(comm)
        upload = torch.zeros((1, 64 if r != 1 else 72), dtype=torch.uint8)
        with pytest.raises(ValueError, match=r"ranks disagree on buffer bytes \(\[64, 72, 64\] by rank\)"):
            agg.aggregate(upload, step=0)
        with pytest.raises(ValueError, match="disagree on step"):
            agg.aggregate(torch.zeros((1, 64), dtype=torch.uint8), step=r)
        return True

    assert run_threads(3, rank) == [True] * 3


def test_bad_arguments_are_refused():
    world = ThreadWorld(1).ranks()[0]
    with pytest.raises(ValueError, match="upload 'sign' or 'l1:BITS'"):
        ClusterAggregator(world, upload="bf16")
    with pytest.raises(ValueError, match="votes use 'majority'"):
        ClusterAggregator(world, result="average")
    with pytest.raises(ValueError, match="momentum_wire"):
        ClusterAggregator(world, momentum_wire="fp16")
    with pytest.raises(TypeError, match="ProcessGroup"):
        ClusterAggregator(object())
    with pytest.raises(ValueError, match=r"upload must be uint8 of shape \(4, nbytes\)"):
        ClusterAggregator(world, upload="l1:4").aggregate(torch.zeros((1, 8), dtype=torch.uint8), step=0)


@pytest.mark.parametrize("wire,rule", [("fp32", "average"), ("bf16", "average"), ("bf16", "trimmed_mean"),
                                       ("fp32", "trimmed_mean")])
def test_momentum_average_equals_the_rows_mean(wire, rule):
    """fp32/average is torch's exact mean of the stacked rows (average_in_process's formula); bf16 is
    the swarm's momentum round: values to bf16, (trimmed) mean of the rows, to bf16 again."""
    n, numel = 4, 1003
    gen = torch.Generator().manual_seed(3)
    values = [torch.randn(numel, generator=gen) * (10 ** torch.randint(-3, 3, (numel,), generator=gen)) for _ in range(n)]

    def rank(r, comm):
        return ClusterAggregator(comm, momentum_wire=wire, momentum_rule=rule).average(values[r], step=1)

    out = run_threads(n, rank)
    rows = torch.stack(values)
    if wire == "bf16":
        rows = rows.to(torch.bfloat16).float()
    if rule == "trimmed_mean":  # n = 4: drop the largest and the smallest of each position
        expected = rows.sort(0).values[1:3].mean(0)
    else:
        expected = rows.mean(0)
    if wire == "bf16":
        expected = expected.to(torch.bfloat16).float()
    for r in range(n):
        assert torch.equal(out[r], expected), r
    if wire == "fp32" and rule == "average":
        copies = [[("m", v.clone())] for v in values]
        average_in_process(copies, MomentumSchedule(every=1))
        assert torch.equal(copies[0][0][1], out[0])


# ---------------------------------------------------------------------------------------------------
# Training: LionCub over the cluster path against the in-process reference, step for step


def _toy_data(i: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * i + step)
    x = torch.randn(16, 12, generator=gen)
    return x, (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()


_INIT = threading.Lock()  # torch's global generator is shared by the rank threads


def _toy_model() -> nn.Module:
    with _INIT:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(12, 33), nn.ReLU(), nn.Linear(33, 3))


def _reference_run(workers: int, steps: int, upload: str, result: str, schedule: MomentumSchedule, seed: int):
    """sim/inprocess.py's vote path: every worker's upload, one reducer (reduce_votes), decode, apply,
    exact momentum average on the schedule. Parameters after every step."""
    up, res = upload_codec(upload), result_codec(result)
    models = [_toy_model() for _ in range(workers)]
    opts = [LionCub(m.named_parameters(), lr=1e-2, weight_decay=0.1, upload=up, seed=seed) for m in models]
    nbytes, history = opts[0].buffer_bytes, []
    for step in range(steps):
        uploads = []
        for i, (model, opt) in enumerate(zip(models, opts)):
            x, y = _toy_data(i, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            uploads.append(opt.compute_upload())
        wire = reduce_votes(uploads, up, res, numel=nbytes * 8, seed=seed, step=step)
        update = res.decode(wire, nbytes * 8, workers * up.max_code)
        for opt in opts:
            opt.apply_aggregate(update)
        if schedule.due(step + 1):
            average_in_process([opt.momentum_buffers() for opt in opts], schedule)
        history.append([p.detach().clone() for p in models[0].parameters()])
    return history, [[m.detach().clone() for _, m in opt.momentum_buffers()] for opt in opts]


def _cluster_rank(rank: int, comm, steps: int, upload: str, result: str, schedule: MomentumSchedule, seed: int):
    model = _toy_model()
    agg = ClusterAggregator(comm, upload=upload, result=result, momentum=schedule, seed=seed)
    opt = LionCub(model.named_parameters(), lr=1e-2, weight_decay=0.1, aggregator=agg, seed=seed)
    history = []
    for step in range(steps):
        x, y = _toy_data(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history, [m.detach().clone() for _, m in opt.momentum_buffers()], agg.stats


@pytest.mark.parametrize("upload,result", [("sign", "majority"), ("l1:4", "mean")])
def test_training_matches_the_in_process_reference_step_for_step(upload, result):
    workers, steps, seed = 3, 12, 5
    schedule = MomentumSchedule(every=4)
    reference, ref_momenta = _reference_run(workers, steps, upload, result, schedule, seed)
    ranks = run_threads(workers, lambda r, comm: _cluster_rank(r, comm, steps, upload, result, schedule, seed))
    for step in range(steps):
        for r, (history, _, _) in enumerate(ranks):
            for got, want in zip(history[step], reference[step]):
                assert torch.equal(got, want), f"rank {r} step {step} differs from the in-process reference"
    for r, (_, momenta, stats) in enumerate(ranks):  # momenta stay each rank's own, equal to the reference's
        assert all(torch.equal(a, b) for a, b in zip(momenta, ref_momenta[r]))
        assert stats.momentum_syncs == steps // 4
    assert not torch.equal(reference[-1][0], _toy_model()[0].weight)  # it trained


# ---------------------------------------------------------------------------------------------------
# Hybrid: local exact counts, one swarm vote, the swarm's update on every local rank


class FakeSwarm:
    """The leader's swarm: its vote plus ``others`` fixed random voters, majority with the run's ties.
    ``mode`` makes it return a float update, replace the leader's state (None), or fail."""

    upload = SignUpload()

    def __init__(self, others: int = 2, seed: int = 0, mode: str = "packed", optimizer: LionCub | None = None):
        self.others, self.seed, self.mode, self.optimizer = others, seed, mode, optimizer
        self.votes: list[torch.Tensor] = []
        self.returned: list[torch.Tensor | None] = []
        self.after_steps = 0

    def aggregate(self, upload: torch.Tensor, *, step: int):
        assert upload.dtype == torch.uint8 and upload.shape[0] == 1
        self.votes.append(upload.clone())
        gen = torch.Generator().manual_seed(step)
        others = [torch.randint(0, 256, upload.shape, dtype=torch.uint8, generator=gen) for _ in range(self.others)]
        packed = reduce_votes([upload] + others, SignUpload(), result_codec("majority"),
                              numel=8 * upload.shape[1], seed=self.seed, step=step)
        if self.mode == "fail":
            raise ConnectionError("no group answered")
        if self.mode == "state" and step == 1:
            with torch.no_grad():
                for p in self.optimizer.param_groups[0]["params"]:
                    p.fill_(0.5)
                for group in self.optimizer.param_groups:
                    group["step"] = 7
            self.returned.append(None)
            return None
        update = ops.unpack_signs(packed, 8 * upload.shape[1]) * 0.5 if self.mode == "float" else packed
        self.returned.append(update)
        return update

    def after_step(self, optimizer):
        """On the run's momentum steps (every 2), a stand-in for the run's average: the leader's momenta change."""
        self.after_steps += 1
        if optimizer.step_count % 2 == 0:
            for _, m in optimizer.momentum_buffers():
                m.mul_(0.5).add_(0.25)


def _hybrid_rank(rank: int, comm, steps: int, mode: str, upload: str = "sign"):
    model = _toy_model()
    swarm = FakeSwarm(seed=9, mode=mode) if rank == 0 else None
    agg = HybridAggregator(comm, swarm, upload=upload, momentum=MomentumSchedule(every=2), seed=9)
    opt = LionCub(model.named_parameters(), lr=1e-2, aggregator=agg, seed=9)
    if swarm is not None:
        swarm.optimizer = opt
    uploads, updates = [], []
    original = agg.local.aggregate

    def spy(u, *, step):
        uploads.append(u.clone())
        out = original(u, step=step)
        return out

    agg.local.aggregate = spy
    real = agg.aggregate

    def spy_update(u, *, step):
        out = real(u, step=step)
        updates.append(None if out is None else out.clone())
        return out

    agg.aggregate = spy_update
    for step in range(steps):
        x, y = _toy_data(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return ([p.detach().clone() for p in model.parameters()], [m.clone() for _, m in opt.momentum_buffers()],
            uploads, updates, swarm, opt.step_count)


@pytest.mark.parametrize("mode,upload", [("packed", "sign"), ("float", "sign"), ("packed", "l1:4")])
def test_hybrid_local_ranks_apply_the_swarms_update(mode, upload):
    n, steps = 3, 4
    out = run_threads(n, lambda r, comm: _hybrid_rank(r, comm, steps, mode, upload))
    swarm = out[0][4]
    for step in range(steps):
        local = [out[r][2][step] for r in range(n)]
        # the leader voted the sign of the exact local count (n = 3 sign votes: never a tie)
        expected_vote = numpy_update(local, upload, "majority", seed=9, step=step)
        assert torch.equal(swarm.votes[step][0], expected_vote), step
        for r in range(n):  # every local rank got the swarm's update, bytes and dtype
            assert torch.equal(out[r][3][step], swarm.returned[step]), (r, step)
    for r in range(1, n):
        assert all(torch.equal(a, b) for a, b in zip(out[0][0], out[r][0])), f"rank {r} parameters differ"
        assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[r][1])), f"rank {r} momenta differ"
    assert swarm.after_steps == steps


def test_hybrid_ties_in_the_local_count_take_the_shared_bit():
    """Two local ranks voting opposite signs tie everywhere: the leader votes the tie stream."""
    nbytes = 517
    a = torch.randint(0, 256, (1, nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    swarms = {0: FakeSwarm(seed=3)}

    def rank(r, comm):
        agg = HybridAggregator(comm, swarms.get(r), seed=3)
        return agg.aggregate(a if r == 0 else ~a, step=6)

    run_threads(2, rank)
    assert torch.equal(swarms[0].votes[0][0], ops.random_tie_bits(3, 6, nbytes))


def test_hybrid_state_replaced_on_the_leader_reaches_every_rank():
    out = run_threads(3, lambda r, comm: _hybrid_rank(r, comm, 3, "state"))
    for r in range(3):
        assert out[r][3][1] is None  # every rank skipped the update of the repaired step
        assert out[r][5] == 8  # the leader's step 7 after the repair, then one more step
        assert all(torch.equal(a, b) for a, b in zip(out[0][0], out[r][0]))
    assert not all(torch.equal(a, torch.full_like(a, 0.5)) for a in out[0][0])  # it trained after the repair


def test_hybrid_failure_on_the_leader_is_raised_on_every_rank():
    def rank(r, comm):
        with pytest.raises(RuntimeError, match="swarm round failed on the leader"):
            _hybrid_rank(r, comm, 1, "fail")
        return True

    assert run_threads(3, rank) == [True] * 3


def test_hybrid_swarm_only_on_the_leader():
    comm = ThreadWorld(2).ranks()
    with pytest.raises(ValueError, match="pass swarm= on local rank 0"):
        HybridAggregator(comm[1], FakeSwarm())
    with pytest.raises(ValueError, match="pass swarm= on local rank 0"):
        HybridAggregator(comm[0], None)


# ---------------------------------------------------------------------------------------------------
# Real gloo ranks (spawned processes on 127.0.0.1) and the butterfly (LocalSwarm) for the same votes


def _rank_entry(rank: int, target, world: int, workdir: str, args: tuple) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's connections stay on the loopback interface
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)
    result = target(rank, world, *args)  # an exception ends this rank with it (spawn reports it)
    torch.save(result, f"{workdir}/rank{rank}.pt")
    dist.barrier()  # every rank done before any leaves
    # and then no teardown: gloo aborts a rank ("terminate called without an active exception") whose
    # pairs close while it tears down its own (seen in two fresh-clone CI runs, once after this barrier,
    # with destroy_process_group); the OS closes the sockets of a process that exits at once
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(target, world: int, workdir: Path, *args, timeout: float = 240.0) -> list:
    """target(rank, world, *args) in ``world`` spawned gloo ranks; their return values (tensors,
    lists, dicts, strings), or the first rank's exception. Every process is gone when this returns."""
    ctx = mp.start_processes(_rank_entry, args=(target, world, str(workdir), args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise AssertionError(f"gloo ranks did not finish within {timeout} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
    return [torch.load(workdir / f"rank{r}.pt", weights_only=True) for r in range(world)]


GLOO_CASES = [(up, res, nbytes) for up in ("sign", "l1:4") for res in ("majority", "ternary", "mean")
              for nbytes in (13, 3001)]


def _gloo_votes(rank: int, world: int, seed: int, step: int) -> dict:
    out = {}
    for upload, result, nbytes in GLOO_CASES:
        uploads = random_uploads(world, nbytes, upload, seed=nbytes * 10 + world)
        agg = ClusterAggregator(None, upload=upload, result=result, seed=seed)
        out[f"{upload}/{result}/{nbytes}"] = agg.aggregate(uploads[rank], step=step)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_gloo_ranks_equal_numpy_and_the_butterfly_byte_for_byte(world, tmp_path):
    from lioncub_p2p.testing import LocalSwarm

    seed, step = 13, 2
    ranks = spawn_ranks(_gloo_votes, world, tmp_path, seed, step)
    with LocalSwarm(world) as swarm:
        for upload, result, nbytes in GLOO_CASES:
            key = f"{upload}/{result}/{nbytes}"
            uploads = random_uploads(world, nbytes, upload, seed=nbytes * 10 + world)
            expected = numpy_update(uploads, upload, result, seed, step)
            butterfly = swarm.allreduce(uploads, upload=upload, result=result, seed=seed, step=step)
            for r in range(world):
                got = ranks[r][key]
                assert got.dtype == expected.dtype and torch.equal(got, expected), f"{key}: rank {r} vs numpy"
                assert butterfly[r] is not None and butterfly[r].dtype == got.dtype, key
                assert got.numpy().tobytes() == butterfly[r].numpy().tobytes(), f"{key}: rank {r} vs butterfly"


def _digits_setup(seed: int):
    from lioncub_p2p.tasks.digits import digits_task

    task = digits_task(seed=0, hidden=32)
    return task, task.make_model(seed)


def _digest(model: nn.Module) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def _gloo_training(rank: int, world: int, steps: int, seed: int) -> list[str]:
    task, model = _digits_setup(seed)
    schedule = MomentumSchedule(every=10)
    agg = ClusterAggregator(None, upload="sign", result="majority", momentum=schedule, seed=seed)
    opt = LionCub(model.named_parameters(), lr=3e-3, weight_decay=0.1, aggregator=agg, seed=seed)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    digests = []
    for _ in range(steps):
        x, y = task.sample(rank, world, 16, gen)
        opt.zero_grad()
        task.loss(model, x, y).backward()
        opt.step()
        digests.append(_digest(model))
    return digests


def _inprocess_digits(world: int, steps: int, seed: int) -> tuple[list[str], nn.Module]:
    """sim/inprocess.py's vote path on the digits: one reducer over all uploads, exact momentum average."""
    task, base = _digits_setup(seed)
    schedule = MomentumSchedule(every=10)
    up, res = upload_codec("sign"), result_codec("majority")
    models = [copy.deepcopy(base) for _ in range(world)]
    opts = [LionCub(m.named_parameters(), lr=3e-3, weight_decay=0.1, upload=up, seed=seed) for m in models]
    gens = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(world)]
    digests = []
    for step in range(steps):
        uploads = []
        for i, (model, opt) in enumerate(zip(models, opts)):
            x, y = task.sample(i, world, 16, gens[i])
            opt.zero_grad()
            task.loss(model, x, y).backward()
            uploads.append(opt.compute_upload())
        wire = reduce_votes(uploads, up, res, numel=8 * opts[0].buffer_bytes, seed=seed, step=step)
        for opt in opts:
            opt.apply_aggregate(wire)
        if schedule.due(step + 1):
            average_in_process([opt.momentum_buffers() for opt in opts], schedule)
        digests.append(_digest(models[0]))
    return digests, models[0]


@pytest.mark.slow
def test_gloo_training_keeps_ranks_equal_and_matches_the_in_process_reference(tmp_path):
    world, steps, seed = 3, 40, 1
    ranks = spawn_ranks(_gloo_training, world, tmp_path, steps, seed)
    reference, model = _inprocess_digits(world, steps, seed)
    for r in range(world):
        for step in range(steps):
            assert ranks[r][step] == reference[step], f"rank {r} differs from the in-process reference at step {step}"
    assert len(set(reference)) == steps  # the parameters moved every step
    task, _ = _digits_setup(seed)
    assert task.evaluate(model)[1] > 50.0  # and learned the digits (10 classes)


class LocalSwarmAggregator:
    """The leader's swarm for a slow hybrid test: a LocalSwarm butterfly where peer 0 votes the box's
    sign and the other peers vote fixed random bits. Keeps every peer's update."""

    upload = SignUpload()

    def __init__(self, swarm, seed: int):
        self.swarm, self.seed = swarm, seed
        self.rounds: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def aggregate(self, upload: torch.Tensor, *, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(100 + step)
        votes = [upload.cpu()] + [torch.randint(0, 256, upload.shape, dtype=torch.uint8, generator=gen)
                                  for _ in range(self.swarm.n - 1)]
        updates = self.swarm.allreduce(votes, seed=self.seed, step=step)
        self.rounds.append((votes, updates))
        return updates[0]


@pytest.mark.slow
def test_hybrid_with_a_real_butterfly_keeps_the_box_equal_to_the_swarm():
    from lioncub_p2p.testing import LocalSwarm

    steps, seed = 4, 9
    with LocalSwarm(3) as swarm:
        leader_swarm = LocalSwarmAggregator(swarm, seed)

        def rank(r, comm):
            model = _toy_model()
            agg = HybridAggregator(comm, leader_swarm if r == 0 else None, seed=seed)
            opt = LionCub(model.named_parameters(), lr=1e-2, aggregator=agg, seed=seed)
            params = []
            for step in range(steps):
                x, y = _toy_data(r, step)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                before = [p.detach().clone() for p in model.parameters()]
                opt.step()
                params.append((before, [p.detach().clone() for p in model.parameters()]))
            return params

        out = run_threads(4, rank, timeout=300)
    assert len(leader_swarm.rounds) == steps
    for step, (votes, updates) in enumerate(leader_swarm.rounds):
        assert all(torch.equal(u, updates[0]) for u in updates)  # every swarm peer applies the same bytes
        assert torch.equal(updates[0], numpy_update(votes, "sign", "majority", seed, step))
        for r in range(4):  # and so does every local rank: its parameters moved by exactly that update
            before, after = out[r][step]
            assert all(torch.equal(a, b) for a, b in zip(out[0][step][1], after)), (r, step)
            probe = _toy_model()
            with torch.no_grad():
                for p, b in zip(probe.parameters(), before):
                    p.copy_(b)
            ref = LionCub(probe.named_parameters(), lr=1e-2, seed=seed)
            ref.apply_aggregate(updates[0])
            assert all(torch.equal(a, b) for a, b in zip(probe.parameters(), after)), (r, step)


# ---------------------------------------------------------------------------------------------------
# The examples, run as users run them


def _run_example(*args: str, timeout: float = 300) -> str:
    """Run an example in its own process group; the whole group (spawned ranks, libp2p daemons) is
    killed if it outlives ``timeout`` (under pytest-timeout's 600 s), after every Python process in it
    printed where it hung (SIGABRT with faulthandler on), or when it is done."""
    import signal
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen([sys.executable, *args], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGABRT)
            stdout, stderr = proc.communicate(timeout=60)
            raise AssertionError(f"{args[0]} hung for {timeout:.0f} s; its stacks:\n{stderr[-20000:]}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    return stdout


@pytest.mark.slow
def test_cluster_example_trains_identical_ranks():
    out = _run_example("examples/multi_gpu/cluster.py", "--ranks", "3", "--steps", "40")
    assert "3 ranks (gloo), 40 steps" in out and "parameters identical: True" in out
    assert float(out.split("test accuracy ")[1].split("%")[0]) > 80.0
    assert "1.33 bits per parameter sent per step" in out  # 2·(n−1)/n: one bit up and one down, own part kept


@pytest.mark.slow
def test_hybrid_example_box_votes_as_one_swarm_peer():
    out = _run_example("examples/multi_gpu/hybrid.py", "--ranks", "2", "--peers", "2", "--steps", "30")
    assert "parameters identical: True" in out
    assert "box: its last round had a group of 3 swarm peers" in out  # 2 volunteers + the box, not 2 + 2 ranks
    assert float(out.split("test accuracy ")[1].split("%")[0]) > 70.0
