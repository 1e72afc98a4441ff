import copy

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


def _reference_lion(model, batches, lr, betas, wd):
    """Lion written out from the paper's pseudo-code with numpy float32 state."""
    params = [p.detach().numpy().astype(np.float32).copy() for p in model.parameters()]
    moms = [np.zeros_like(p) for p in params]
    ref = copy.deepcopy(model)
    for x, y in batches:
        for p, v in zip(ref.parameters(), params):
            p.data = torch.from_numpy(v.copy())
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        for i, p in enumerate(ref.parameters()):
            g = p.grad.numpy()
            c = betas[0] * moms[i] + (1 - betas[0]) * g
            params[i] = params[i] * (1 - lr * wd) - lr * np.sign(c)
            moms[i] = betas[1] * moms[i] + (1 - betas[1]) * g
    return params


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
