import copy
import json

import numpy as np
import pytest
import torch
from torch import nn

from lioncub_p2p import LionCub
from lioncub_p2p.codecs import SignUpload, reduce_votes, MajorityResult
from lioncub_p2p.momentum import MomentumSchedule, average_in_process


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))


def _batches(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(steps)]


def _reference_lion(model, batches, lr, betas, wd, delay=0):
    """Lion written out from the paper's pseudo-code with numpy float32 state; with ``delay`` = 1 the
    direction of step t is applied at step t + 1 (nothing at step 0)."""
    params = [p.detach().numpy().astype(np.float32).copy() for p in model.parameters()]
    moms = [np.zeros_like(p) for p in params]
    ref = copy.deepcopy(model)
    waiting = []  # directions not applied yet
    for x, y in batches:
        for p, v in zip(ref.parameters(), params):
            p.data = torch.from_numpy(v.copy())
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        waiting.append([])
        for i, p in enumerate(ref.parameters()):
            g = p.grad.numpy()
            waiting[-1].append(np.sign(betas[0] * moms[i] + (1 - betas[0]) * g))
            moms[i] = betas[1] * moms[i] + (1 - betas[1]) * g
        if len(waiting) > delay:
            for i, u in enumerate(waiting.pop(0)):
                params[i] = params[i] * (1 - lr * wd) - lr * u
    return (params, waiting) if delay else params


def _train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def test_alone_is_plain_lion():
    model, batches = _model(), _batches(20)
    expected = _reference_lion(model, batches, 1e-2, (0.9, 0.99), 0.1)
    opt = LionCub(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    _train(model, opt, batches)
    for p, e in zip(model.parameters(), expected):
        assert np.abs(p.detach().numpy() - e).max() <= 1e-6
    assert opt.step_count == 20


class SoloAggregator:
    """A group of one: the majority of a single vote is the vote itself."""

    upload = SignUpload()

    def aggregate(self, upload, *, step):
        return reduce_votes([upload], self.upload, MajorityResult(), numel=upload.shape[1] * 8, step=step)


class OverlappedSoloAggregator(SoloAggregator):
    """The same group of one with rounds in flight: ``submit`` records the vote, ``wait`` returns it."""

    delay = 1

    def __init__(self):
        self.submitted = []

    def submit(self, upload, *, step):
        from lioncub_p2p.optim import Resolved

        self.submitted.append(step)
        return Resolved(self.aggregate(upload, step=step))


def test_overlapped_rounds_apply_each_vote_one_step_later():
    """delay = 1 against the numpy reference that applies step t's direction at step t + 1 (so each
    gradient is taken one update behind: not plain Lion's trajectory); flush() applies the last one."""
    model, batches = _model(), _batches(12)
    expected, (last,) = _reference_lion(model, batches, 1e-2, (0.9, 0.99), 0.1, delay=1)
    undelayed = _reference_lion(model, batches, 1e-2, (0.9, 0.99), 0.1)
    aggregator = OverlappedSoloAggregator()
    opt = LionCub(model.parameters(), lr=1e-2, weight_decay=0.1, aggregator=aggregator)
    _train(model, opt, batches)
    assert aggregator.submitted == list(range(12)) and opt.step_count == 12
    for p, e in zip(model.parameters(), expected):
        assert np.abs(p.detach().numpy() - e).max() <= 1e-6
    assert max(np.abs(p.detach().numpy() - e).max() for p, e in zip(model.parameters(), undelayed)) > 1e-3
    in_flight = opt.in_flight_update()
    assert in_flight is not None
    opt.flush()  # the 12th direction, applied without starting a 13th vote
    assert opt.in_flight_update() is None and opt.step_count == 12 and aggregator.submitted == list(range(12))
    for p, e, u in zip(model.parameters(), expected, last):
        assert np.abs(p.detach().numpy() - (e * (1 - 1e-2 * 0.1) - 1e-2 * u)).max() <= 1e-6


def test_a_snapshot_taken_with_a_round_in_flight_carries_its_update():
    """A peer restored from a snapshot taken between overlapped steps continues bit for bit like the
    original: the update in flight travels with the parameters (and is covered by the digest)."""
    from lioncub_p2p.swarm import snapshot

    model, batches = _model(), _batches(10)
    opt = LionCub(model.named_parameters(), lr=1e-2, weight_decay=0.1, aggregator=OverlappedSoloAggregator())
    _train(model, opt, batches[:5])
    blob, digest = snapshot.encode(opt)
    twin_model = _model(seed=7)
    twin = LionCub(twin_model.named_parameters(), lr=1e-2, weight_decay=0.1, aggregator=OverlappedSoloAggregator())
    assert snapshot.load(twin, blob, expect_digest=digest) == 5
    assert torch.equal(twin.in_flight_update(), opt.in_flight_update())
    _train(model, opt, batches[5:])
    _train(twin_model, twin, batches[5:])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))
    assert snapshot.step_and_params_digest(blob) == (5, digest)
    tampered = bytearray(blob)
    tampered[-1] ^= 1  # the last byte of the in-flight update
    with pytest.raises(snapshot.SnapshotError, match="digest"):
        snapshot.load(twin, tampered, expect_digest=digest)
    header, offset = snapshot.read_header(blob)
    for pending in ([], {}, "int64", 7):  # hostile headers: one clear error each, the twin untouched
        forged = json.dumps({**header, "pending": pending}).encode()
        bad = snapshot.MAGIC + len(forged).to_bytes(4, "little") + forged + blob[offset:]
        with pytest.raises(snapshot.SnapshotError, match="in-flight update"):
            snapshot.load(twin, bad)
    assert torch.equal(twin.in_flight_update(), opt.in_flight_update())  # the refused loads changed nothing
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))


def test_a_parameter_whose_direction_is_zero_on_every_peer_moves_no_further_than_weight_decay():
    """g = 0 and m = 0 everywhere (a parameter outside the loss): 1-bit votes cannot abstain, so each
    step's vote is the shared stream's bit, unanimous. Steps 2k and 2k + 1 use inverted bits: the
    parameter is at θ0·(1 − lr·λ)^t after every even step t, and never more than lr away from it (with
    unpaired bits it random-walks: ~lr·√t). Checked against that formula in numpy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 3))
    unused = nn.Parameter(torch.randn(1000))
    params = [*model.parameters(), unused]
    lr, wd = 1e-3, 0.1
    opt = LionCub(params, lr=lr, weight_decay=wd, aggregator=SoloAggregator())
    start = unused.detach().numpy().copy()
    x, y = torch.randn(16, 10), torch.randint(0, 3, (16,))
    for t in range(1, 61):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        upload = opt.compute_upload()  # three replicas of one state vote alike: the vote is unanimous
        update = reduce_votes([upload] * 3, SignUpload(), MajorityResult(), numel=upload.shape[1] * 8, step=t - 1)
        opt.apply_aggregate(update)
        decayed = start * np.float32(1 - lr * wd) ** t
        gap = np.abs(unused.detach().numpy() - decayed).max()
        assert gap <= (0 if t % 2 == 0 else lr) + 1e-5, (t, gap)  # 1e-5: float32 rounding of |θ| ≤ 4


def test_packed_path_of_one_peer_is_lion():
    """Through the fused kernels and codecs, one peer trains exactly like Lion (c is never 0 here)."""
    model, batches = _model(), _batches(20)
    expected = _reference_lion(model, batches, 1e-2, (0.9, 0.99), 0.1)
    opt = LionCub(model.parameters(), lr=1e-2, weight_decay=0.1, aggregator=SoloAggregator())
    _train(model, opt, batches)
    for p, e in zip(model.parameters(), expected):
        assert np.abs(p.detach().numpy() - e).max() <= 1e-6


def test_state_dict_round_trip_and_groups():
    model = _model()
    groups = [{"params": list(model[0].parameters()), "lr": 1e-2}, {"params": list(model[2].parameters()), "lr": 1e-3}]
    opt = LionCub(groups, weight_decay=0.0)
    _train(model, opt, _batches(3))
    saved = copy.deepcopy(opt.state_dict())
    clone = _model()
    clone.load_state_dict(model.state_dict())
    opt2 = LionCub([{"params": list(clone[0].parameters()), "lr": 1e-2},
                    {"params": list(clone[2].parameters()), "lr": 1e-3}])
    opt2.load_state_dict(saved)
    assert opt2.step_count == 3
    more = _batches(4, seed=7)
    _train(model, opt, more)
    _train(clone, opt2, more)
    for a, b in zip(model.parameters(), clone.parameters()):
        assert torch.equal(a, b)


def test_named_parameters_name_the_momenta():
    model = _model()
    opt = LionCub(model.named_parameters())
    assert [name for name, _ in opt.momentum_buffers()] == [n for n, _ in model.named_parameters()]
    assert opt.buffer_bytes == sum((p.numel() + 7) // 8 for p in model.parameters())


def test_bad_hyperparameters():
    with pytest.raises(ValueError, match="lr"):
        LionCub(_model().parameters(), lr=0)
    with pytest.raises(ValueError, match="betas"):
        LionCub(_model().parameters(), betas=(0.9, 1.5))
    opt = LionCub(_model().parameters())
    with pytest.raises(ValueError, match="expected"):
        opt.apply_aggregate(torch.zeros(3, dtype=torch.uint8))


def test_schedules():
    every = MomentumSchedule(every=4)
    assert [s for s in range(1, 13) if every.due(s)] == [4, 8, 12]
    until = MomentumSchedule(every=2, until=6)
    assert [s for s in range(1, 13) if until.due(s)] == [2, 4, 6]
    geo = MomentumSchedule(geometric=2.0, start=1)
    assert [s for s in range(1, 40) if geo.due(s)] == [1, 2, 4, 8, 16, 32]
    named = MomentumSchedule(every=1, params=("0.*",))
    assert named.selects("0.weight") and not named.selects("2.weight")
    assert not MomentumSchedule.never().due(5)
    assert every.syncs_per_step(12) == 0.25
    with pytest.raises(ValueError):
        MomentumSchedule(geometric=1.0)


def test_in_process_average_is_exact_mean_of_selected():
    models = [_model() for _ in range(3)]
    opts = [LionCub(m.named_parameters()) for m in models]
    for i, (m, o) in enumerate(zip(models, opts)):
        _train(m, o, _batches(2, seed=10 + i))
    before = [[t.clone() for _, t in o.momentum_buffers()] for o in opts]
    average_in_process([o.momentum_buffers() for o in opts], MomentumSchedule(every=1, params=("0.*",)))
    names = [n for n, _ in opts[0].momentum_buffers()]
    for k, name in enumerate(names):
        mean = sum(b[k] for b in before) / 3
        for o, b in zip(opts, before):
            now = o.momentum_buffers()[k][1]
            if name.startswith("0."):
                torch.testing.assert_close(now, mean, rtol=0, atol=1e-7)
            else:
                assert torch.equal(now, b[k])


# -- lr_schedule, step(closure), and the fused kernels against the per-tensor path -------------------


class EchoAggregator:
    """Returns this peer's own packed signs: the fused upload path, then the fused apply path."""

    upload = SignUpload()

    def aggregate(self, upload, *, step):
        return upload[0].clone()


def _two_group_model(seed=0):
    model = _model(seed)
    groups = [{"params": list(model[0].parameters()), "lr": 1e-2},
              {"params": list(model[2].parameters()), "lr": 4e-3, "weight_decay": 0.3}]
    return model, groups


@pytest.mark.parametrize("aggregator", [None, "echo"])
def test_lr_schedule_scales_every_groups_lr_by_the_step(aggregator):
    """Each step moves each parameter by exactly group lr × schedule(step) (a hand-computed Lion step
    in numpy; c is never 0 here, so sign and packed vote agree)."""
    model, groups = _two_group_model()
    seen = []

    def schedule(step):
        seen.append(step)
        return 1.0 / (1 + step)

    opt = LionCub(groups, betas=(0.9, 0.99), weight_decay=0.1, lr_schedule=schedule,
                  aggregator=EchoAggregator() if aggregator else None)
    params = [p.detach().numpy().astype(np.float32).copy() for p in model.parameters()]
    moms = [np.zeros_like(p) for p in params]
    group_of = [0, 0, 1, 1]
    for step, (x, y) in enumerate(_batches(4)):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for i, p in enumerate(model.parameters()):
            group = groups[group_of[i]]
            lr = group["lr"] * (1.0 / (1 + step))
            wd = group.get("weight_decay", 0.1)
            g = p.grad.numpy()
            c = 0.9 * moms[i] + 0.1 * g
            params[i] = params[i] * (1 - lr * wd) - lr * np.sign(c)
            moms[i] = 0.99 * moms[i] + 0.01 * g
        opt.step()
        for p, e in zip(model.parameters(), params):
            np.testing.assert_allclose(p.detach().numpy(), e, rtol=0, atol=2e-6)
    assert set(seen) == {0, 1, 2, 3} and opt.step_count == 4


@pytest.mark.parametrize("aggregator", [None, "echo"])
def test_step_with_closure_computes_the_loss_with_grad_and_returns_it(aggregator):
    model = _model()
    opt = LionCub(model.parameters(), lr=1e-2, aggregator=EchoAggregator() if aggregator else None)
    x, y = _batches(1)[0]
    calls = []

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # raises if the closure ran without grad
        calls.append((torch.is_grad_enabled(), loss))
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        loss = opt.step(closure)
    assert len(calls) == 1 and calls[0][0] is True
    assert loss is calls[0][1]
    for b, p in zip(before, model.parameters()):  # one Lion step from zero momentum: θ − lr·sign(g)
        g = p.grad
        assert torch.equal(p.detach()[g != 0], (b - 1e-2 * torch.sign(g))[g != 0])
    assert opt.step_count == 1


def _many_tensor_model(seed, dtype=torch.float32):
    """Many small tensors of odd sizes, two groups, one parameter without a gradient."""
    torch.manual_seed(seed)
    layers = [nn.Linear(9, 13), nn.Tanh(), nn.Linear(13, 7), nn.Tanh(), nn.Linear(7, 3)]
    model = nn.Sequential(*layers).to(dtype)
    model.register_parameter("unused", nn.Parameter(torch.randn(5).to(dtype)))
    params = list(model.named_parameters())
    groups = [{"params": [p for _, p in params[:3]], "betas": (0.9, 0.99)},
              {"params": [p for _, p in params[3:]], "betas": (0.8, 0.95), "lr": 3e-3, "weight_decay": 0.2}]
    return model, groups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_upload_and_apply_equal_the_per_tensor_path_bitwise(dtype):
    """compute_upload/apply_aggregate (one numba call for all float32 tensors) give the bytes,
    momenta and parameters of the per-tensor torch path they replaced, step after step; exact
    zeros in the direction (dead inputs) take the seeded stream's bits in both."""
    from lioncub_p2p.optim import reference_apply, reference_upload

    model_a, groups_a = _many_tensor_model(3, dtype)
    model_b = copy.deepcopy(model_a)
    groups_b = [{**g, "params": [dict(model_b.named_parameters())[n] for n, p in model_a.named_parameters()
                                 if any(p is q for q in g["params"])]} for g in groups_a]
    opt_a = LionCub(groups_a, lr=1e-2, weight_decay=0.1, seed=11, aggregator=EchoAggregator())
    opt_b = LionCub(groups_b, lr=1e-2, weight_decay=0.1, seed=11, aggregator=EchoAggregator())
    g = torch.Generator().manual_seed(4)
    for step in range(4):
        x = torch.randn(16, 9, generator=g).to(dtype)
        x[:, :3] = 0  # inputs that never fire: exact zeros in gradients and momenta
        for model in (model_a, model_b):
            model.zero_grad()
            model(x).float().square().mean().backward()
        up_a, up_b = opt_a.compute_upload(), reference_upload(opt_b)
        assert torch.equal(up_a, up_b), f"upload differs at step {step}"
        update = torch.rand(opt_a.buffer_bytes * 8, generator=g) * 2 - 1 if step % 2 else up_a[0]
        opt_a.apply_aggregate(update)
        reference_apply(opt_b, update)
        for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
            assert torch.equal(a, b), f"{name} differs at step {step}"
        for (_, ma), (_, mb) in zip(opt_a.momentum_buffers(), opt_b.momentum_buffers()):
            assert torch.equal(ma, mb)
    assert opt_a.step_count == opt_b.step_count == 4
