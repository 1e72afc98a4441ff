"""What a trainer reports of its task's evaluation: in a step's metrics, and at the end of its run
(shared by lioncub-train and its hivemind baseline, ``baseline.py``)."""
from __future__ import annotations

import json
from pathlib import Path

from ..tasks import TrainingTask


def evaluate_into(record: dict, task: TrainingTask) -> None:
    """Add the task's evaluation to a metrics record (``eval_loss``, ``eval_<name>``)."""
    for name, value in task.evaluation().items():
        record[f"eval_{name}"] = value


def finish(final_eval: str | None, task: TrainingTask, step: int) -> None:
    """Print the final evaluation in one line; write it as JSON to ``final_eval`` (the simulator reads it)."""
    results = task.evaluation()
    summary = ", ".join(f"test {name.replace('_', ' ')} {value:.3f}" for name, value in results.items())
    print(f"finished at step {step}" + (f": {summary}" if summary else ""), flush=True)
    if final_eval:
        Path(final_eval).write_text(json.dumps({"step": step, **{f"eval_{k}": v for k, v in results.items()}}))
