import json

from lioncub_p2p.momentum import MomentumSchedule
from lioncub_p2p.sim.inprocess import DEFAULT_METHODS, Method, main, run_method
from lioncub_p2p.tasks.digits import digits_task


def test_majority_with_momentum_averaging_tracks_global_lion():
    """Same seed, samples and lr (digits MLP 64 wide, 4 workers, 300 steps: global 92.5% / train loss 0.231,
    the vote 92.5% / 0.237 when measured)."""
    task = digits_task(0, hidden=64)
    global_lion = run_method(Method("global"), task, workers=4, steps=300)
    vote = run_method(Method("vote", "sign", "majority", MomentumSchedule(every=10)), task, workers=4, steps=300)
    assert global_lion.test_accuracy > 88.0 and global_lion.train_loss < 0.4  # the baseline itself learned
    assert vote.test_accuracy >= global_lion.test_accuracy - 3.0
    assert vote.train_loss < 1.15 * global_lion.train_loss
    assert vote.replicas_identical
    assert vote.bits_per_element_per_step == 2.0 + 32.0 / 10  # 1 bit up + 1 down, bf16 momentum every 10


def test_cli_writes_table_and_json(tmp_path, capsys):
    """The default methods on the default task (digits), one seed, a few steps."""
    out = tmp_path / "r.json"
    main(["--steps", "6", "--seeds", "1", "--hidden", "16", "--window", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    names = [r["method"] for r in report["runs"]]
    assert names == list(DEFAULT_METHODS) and names[0] == "global"
    assert all(o["replicas_identical"] and o["steps"] == 6 for r in report["runs"] for o in r["outcomes"])
    assert report["eval_at"] == [1, 3, 4, 6] and report["target_step"] == 4
    assert "| global | 0.0003 | 64.00 |" in capsys.readouterr().out
