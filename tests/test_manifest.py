"""The run manifest: one-line errors for bad files, adoption and refusal by joiners, the leader's check."""
from __future__ import annotations

import threading
import time

import pytest

from hivemind import DHT
from torch import nn

from lioncub_p2p import LionCub
from lioncub_p2p.testing import SWARM_ROUNDS
from lioncub_p2p.identity import Identity
from lioncub_p2p.momentum import MomentumSchedule
from lioncub_p2p.swarm import Manifest, ManifestError, SettingsMismatch, Swarm, SwarmConfig, publish_manifest
from lioncub_p2p.swarm.manifest import DEFAULTS, SWARM_FIELDS, ManifestMismatch, resolve
from lioncub_p2p.swarm.membership import Directory, PeerRecord
from lioncub_p2p.wire import PROTOCOL_VERSION

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
FAST = SWARM_ROUNDS


# -- files ---------------------------------------------------------------------------------------------

def test_manifest_from_yaml_reads_a_run_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("task: digits\ntask_args: {hidden: 256}\nupload: l1\nlr: 3e-4\nbetas: [0.9, 0.99]\n"
                    "momentum: {every: 20, until: 1000}\nbatch_size: 32\nsecret_required: true\n")
    m = Manifest.from_yaml(path)
    assert (m.task, m.task_args, m.upload, m.lr, m.betas, m.batch_size) == ("digits", {"hidden": 256}, "l1:4", 3e-4,
                                                                             (0.9, 0.99), 32)
    assert m.momentum_schedule().due(20) and not m.momentum_schedule().due(1020)
    assert Manifest.from_payload(m.payload()) == m and Manifest.from_payload(m.payload()).digest() == m.digest()
    streamed = Manifest(momentum={"slices": 25})
    assert Manifest.from_payload(streamed.payload()).momentum_schedule() == MomentumSchedule(slices=25)
    assert "wire" not in streamed.momentum  # bf16: the map of a manifest from before fp8
    fp8 = Manifest(momentum={"slices": 25, "wire": "fp8"})
    assert Manifest.from_payload(fp8.payload()).momentum_schedule() == MomentumSchedule(slices=25, wire="fp8")
    assert fp8.digest() != streamed.digest()
    # a run file of an older version: audit_every (voters audit every round now) is read and dropped
    (tmp_path / "old.yaml").write_text(path.read_text() + "audit_every: 5\n")
    old = Manifest.from_yaml(tmp_path / "old.yaml")
    assert old == m and "audit_every" not in old.payload()


@pytest.mark.parametrize("text, expected", [
    (None, "cannot read the manifest"),
    ("lr: [1, 2\n", "not valid YAML at line"),
    ("", "the manifest is empty"),
    ("- a\n- b\n", "must be a map"),
    ("lrr: 1e-3\n", "unknown field 'lrr'"),
    ("lr: abc\n", "lr must be a positive number"),
    ("lr: -1\n", "lr must be a positive number"),
    ("upload: foo\n", "upload: unknown upload encoding"),
    ("upload: l1:99\n", "upload: l1 upload needs"),
    ("result: foo\n", "result: unknown result encoding"),
    ("momentum: {every: -1}\n", "momentum.every must be an integer"),
    ("momentum: {often: 3}\n", "momentum must be a map"),
    ("momentum: {slices: -2}\n", "momentum.slices must be an integer"),
    ("momentum: {every: 20, slices: 4}\n", "slices (streamed averaging) replaces every"),
    ("momentum: {every: 20, wire: fp4}\n", "momentum: wire must be bf16 or fp8, got 'fp4'"),
    ("upload: fp8\n", "upload: fp8 is a momentum format, not a vote's"),
    ("batch_size: 0\n", "batch_size must be an integer"),
    ("betas: [0.9, 1.0]\n", "betas must be two numbers"),
    ("layout_hash: xyz\n", "layout_hash must be 32 hex digits"),
    ("secret_required: maybe\n", "secret_required must be true or false"),
    ("transport: carrier-pigeon\n", "transport must be butterfly or allgather"),
    ("max_group: 1\n", "max_group must be 0 (one flat group) or at least 2"),
    ("max_group: -3\n", "max_group must be an integer"),
    ("max_group: 32\nresult: ternary\n", "max_group needs upload sign, result majority and transport butterfly"),
    ("max_group: 32\ntransport: allgather\n", "max_group needs upload sign"),
])
def test_manifest_from_yaml_names_the_problem_in_one_line(tmp_path, text, expected):
    path = tmp_path / "run.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ManifestError) as error:
        Manifest.from_yaml(path)
    message = str(error.value)
    assert expected in message and message.startswith(str(path)) and "\n" not in message


def test_max_group_is_a_swarm_setting_absent_unless_set():
    """A run without a two-level vote writes no max_group (older peers read its manifest as before);
    one with it carries it, and a joiner adopts it like any swarm setting."""
    assert "max_group" not in DEFAULTS.payload()
    two_level = Manifest(max_group=32, upload="sign", result="majority")
    assert Manifest.from_payload(two_level.payload()) == two_level and "max_group" in SWARM_FIELDS
    assert resolve(Manifest(), two_level, "r").max_group == 32


def test_resolve_adopts_what_a_peer_has_no_opinion_on_and_names_a_conflict():
    run = Manifest(protocol=PROTOCOL_VERSION, upload="l1:4", lr=1e-3).merged(DEFAULTS)
    adopted = resolve(Manifest(protocol=PROTOCOL_VERSION, lr=1e-3), run, "demo")
    assert adopted.upload == "l1:4" and adopted.momentum == {"every": 0, "start": 1, "slices": 20, "wire": "fp8"}
    with pytest.raises(ManifestMismatch, match=r"this peer's upload=sign differs from run demo's upload=l1:4 "
                                               r"\(also lr\): leave it unset"):
        resolve(Manifest(protocol=PROTOCOL_VERSION, upload="sign", lr=3e-4), run, "demo")
    with pytest.raises(ManifestMismatch, match="speaks protocol version 99.*upgrade lioncub-p2p"):
        resolve(Manifest(protocol=PROTOCOL_VERSION), Manifest(protocol=99), "demo")


# -- in a swarm ------------------------------------------------------------------------------------------

def _model(hidden: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(5, hidden), nn.ReLU(), nn.Linear(hidden, 3))


def _config(run_id: str, **kwargs) -> SwarmConfig:
    return SwarmConfig(run_id, **{"host_maddrs": LOOPBACK, "allreduce": FAST, "join_timeout": 20.0, **kwargs})


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.mark.slow
def test_joiners_adopt_the_run_manifest_and_refuse_other_settings_and_models():
    founder = Swarm(_config("manifest", upload="l1:4", momentum_rule="average",
                            manifest=Manifest(task="mlp", task_args={"hidden": 16}, batch_size=8)))
    # the founder waits for the joiner (without stepping, a group would list it from a step never reached)
    founder_errors: list[Exception] = []

    def found() -> None:
        try:
            founder.join(LionCub(_model().named_parameters(), lr=1e-3, aggregator=founder), wait_peers=2,
                         wait_timeout=60)
        except Exception as e:  # asserted below
            founder_errors.append(e)

    waiting = threading.Thread(target=found, daemon=True)
    try:
        waiting.start()
        assert _wait(lambda: founder.run_manifest is not None and founder.history.latest is not None, 30)
        published = founder.run_manifest
        assert published.layout_hash and published.param_count == sum(p.numel() for p in _model().parameters())
        assert (published.upload, published.lr, published.task) == ("l1:4", 1e-3, "mlp")
        peers = founder.visible_maddrs()

        joiner = Swarm(_config("manifest", initial_peers=peers))  # no opinions: takes the run's
        try:
            assert joiner.manifest.upload == "l1:4" and joiner.config.momentum_rule == "average"
            assert (joiner.manifest.task_args, joiner.manifest.batch_size, joiner.manifest.lr) == ({"hidden": 16}, 8, 1e-3)
            model = _model(joiner.manifest.task_args["hidden"])  # what a CLI does: build the run's model
            joiner.join(LionCub(model.named_parameters(), lr=joiner.manifest.lr, aggregator=joiner), wait_peers=2,
                        wait_timeout=60)
            waiting.join(60)
            assert not waiting.is_alive() and not founder_errors, founder_errors
            assert joiner.run_manifest.digest() == published.digest()
            assert _wait(lambda: joiner.peer_id in founder.history.latest.member_ids(), 10)
        finally:
            joiner.shutdown()

        started = time.monotonic()
        with pytest.raises(SettingsMismatch, match="this peer's upload=sign differs from run manifest's upload=l1:4"):
            Swarm(_config("manifest", initial_peers=peers, upload="sign"))
        assert time.monotonic() - started < 10
        other_model = Swarm(_config("manifest", initial_peers=peers))
        try:
            count = sum(p.numel() for p in _model(17).parameters())
            with pytest.raises(SettingsMismatch, match=rf"this peer's model differs from run manifest's \({count} param"):
                other_model.join(LionCub(_model(17).named_parameters(), lr=1e-3, aggregator=other_model))
        finally:
            other_model.shutdown()
        other_lr = Swarm(_config("manifest", initial_peers=peers))
        try:
            with pytest.raises(SettingsMismatch, match="lr=0.01 differs from run manifest's lr=0.001"):
                other_lr.join(LionCub(_model().named_parameters(), lr=1e-2, aggregator=other_lr))
        finally:
            other_lr.shutdown()
    finally:
        founder.shutdown()


@pytest.mark.slow
def test_a_coordinators_manifest_is_the_founders_and_the_leader_keeps_out_other_manifests():
    coordinator_id = Identity.load_or_create(None)
    coordinator = DHT(start=True, host_maddrs=LOOPBACK, identity_path=coordinator_id.path)
    founder = None
    try:
        assert publish_manifest(coordinator, "coord", Manifest(upload="l1:3", momentum={"every": 7}), coordinator_id)
        peers = [str(m) for m in coordinator.get_visible_maddrs()]
        founder = Swarm(_config("coord", initial_peers=peers))
        assert founder.config.upload == "l1:3" and founder.config.momentum.every == 7  # before any group existed
        founder.join(LionCub(_model().named_parameters(), lr=1e-3, aggregator=founder))
        assert founder.run_manifest.upload == "l1:3" and founder.run_manifest.layout_hash  # completed by the founder

        # a peer (validly signed, open run) that follows another manifest never enters the group...
        outsider = Identity.load_or_create(None)
        directory = Directory(founder.dht, "coord", outsider)
        record = PeerRecord(outsider.peer_id, synced=True, manifest=Manifest(upload="sign").digest())
        for _ in range(6):
            founder.loop.run(directory.announce(record, 10.0), timeout=10)
            time.sleep(0.5)
        assert outsider.peer_id in founder.records and outsider.peer_id not in founder.history.latest.member_ids()
        # ...and the same record with the run's manifest does (the check above is what kept it out)
        record.manifest = founder.run_manifest.digest()
        founder.loop.run(directory.announce(record, 10.0), timeout=10)
        assert _wait(lambda: outsider.peer_id in founder.history.latest.member_ids(), 10)
    finally:
        if founder is not None:
            founder.shutdown()
        coordinator.shutdown()
