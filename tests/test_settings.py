"""RunSettings without a network: a founder's settings become the run's; a joiner adopts the run's
where it has no opinion and stops with one line where it differs (tests/test_manifest.py runs the
same through the DHT)."""
import pytest
from torch import nn

from lioncub_p2p.optim import LionCub
from lioncub_p2p.swarm import manifest as manifests
from lioncub_p2p.swarm.errors import AdmissionRefused, SettingsMismatch
from lioncub_p2p.swarm.manifest import Manifest
from lioncub_p2p.swarm.settings import RunSettings
from lioncub_p2p.swarm.snapshot import Layout


def _optimizer(width: int = 4, lr: float = 1e-3) -> LionCub:
    return LionCub(nn.Linear(width, 2).named_parameters(), lr=lr)


def _applied(settings: RunSettings) -> Manifest:
    return Manifest(**{name: getattr(settings.current, name) for name in manifests.SWARM_FIELDS})


def test_a_founders_settings_with_its_optimizers_layout_become_the_runs():
    founder = RunSettings("run", Manifest(upload="l1:3"))
    opt = _optimizer()
    founder.settle(opt, _applied(founder), founding=True)
    layout = Layout.of(opt)
    assert founder.run is founder.current
    assert (founder.run.upload, founder.run.lr) == ("l1:3", 1e-3)
    assert (founder.run.layout_hash, founder.run.param_count) == (layout.digest(), layout.param_count())


def test_a_joiner_adopts_the_runs_settings_and_stops_on_another_model_or_lr():
    founder = RunSettings("run", Manifest(upload="l1:3"))
    founder.settle(_optimizer(), _applied(founder), founding=True)
    joiner = RunSettings("run", Manifest())
    joiner.adopt(founder.run)
    assert joiner.current.upload == "l1:3" and joiner.run is founder.run
    joiner.settle(_optimizer(), _applied(joiner), founding=False)
    assert joiner.current.digest() == founder.run.digest() and joiner.run is founder.run
    with pytest.raises(SettingsMismatch, match="this peer's model differs from run run's .*build the run's model"):
        joiner.settle(_optimizer(width=5), _applied(joiner), founding=False)
    with pytest.raises(SettingsMismatch, match="lr"):
        joiner.settle(_optimizer(lr=2e-3), _applied(joiner), founding=False)
    with pytest.raises(SettingsMismatch, match="appeared after this Swarm was created and sets upload"):
        _late_manifest(founder.run)


def _late_manifest(run: Manifest) -> None:
    """A peer that started before the run's manifest appeared runs the library defaults."""
    late = RunSettings("run", Manifest())
    started_with = _applied(late)  # upload "sign": no manifest read at start
    late.adopt(run)
    late.settle(_optimizer(), started_with, founding=False)


def test_an_opinion_or_secret_the_run_does_not_share_is_one_line():
    run = Manifest(upload="l1:3", secret_required=True)
    with pytest.raises(SettingsMismatch, match="upload"):
        RunSettings("run", Manifest(upload="sign", secret_required=True)).adopt(run)
    with pytest.raises(AdmissionRefused, match="run run is private: pass its --run-secret"):
        RunSettings("run", Manifest(secret_required=False)).adopt(run)
    with pytest.raises(AdmissionRefused, match="is open .*drop --run-secret"):
        RunSettings("run", Manifest(secret_required=True)).adopt(Manifest(secret_required=False))
    kept = RunSettings("run", Manifest())
    kept.adopt(None)  # no manifest published yet: the defaults, no run
    assert kept.run is None and kept.current.upload == manifests.DEFAULTS.upload
