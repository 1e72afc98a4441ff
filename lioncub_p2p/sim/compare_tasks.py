"""What ``lioncub-compare`` trains: a task as the in-process comparison sees it (``CompareTask``: a
model per seed, a batch source per worker, a loss, an evaluation), for the simulators' sharded tasks
(``LegacyTask``) and for the tasks ``lioncub-train`` trains (``SpecTask``)."""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..tasks import TrainingTask, load_task


class CompareTask:
    """A task as the comparison sees it: a model per seed, per-worker batches, a loss, an evaluation."""

    name = "task"

    def make_model(self, seed: int) -> nn.Module:
        raise NotImplementedError

    def batches(self, workers: int, batch: int, gens: list[torch.Generator]) -> list[Callable[[], Any]]:
        """One batch source per worker for a run."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {}

    def train_loss(self, model: nn.Module) -> float:
        """Loss on the whole training set, for tasks that hold one in memory (NaN otherwise)."""
        return float("nan")


class LegacyTask(CompareTask):
    """The simulators' sharded tasks (``lioncub_p2p.tasks``: ``Task``, ``ByteLMTask``): worker i draws from
    shard i; ``evaluate`` gives (test loss, accuracy or bits per byte)."""

    def __init__(self, task: Any):
        self.task, self.name = task, getattr(task, "name", "task")

    def make_model(self, seed: int) -> nn.Module:
        return self.task.make_model(seed)

    def batches(self, workers, batch, gens):
        return [lambda i=i: self.task.sample(i, workers, batch, gens[i]) for i in range(workers)]

    def loss(self, model, batch):
        return self.task.loss(model, *batch)

    def evaluate(self, model):
        loss, second = self.task.evaluate(model)
        return {"loss": loss, "accuracy" if hasattr(self.task, "x_train") else "bits_per_byte": second}

    @torch.no_grad()
    def train_loss(self, model):
        if not hasattr(self.task, "x_train"):
            return float("nan")
        return self.task.loss(model, self.task.x_train, self.task.y_train).item()


class SpecTask(CompareTask):
    """A task of ``lioncub_p2p.tasks`` (``digits``, ``byte-gpt``, ``module:function``), as
    ``lioncub-train`` trains it: each worker draws from a sampler with its own generator; an iterable
    of batches is dealt out in turn (worker 0 gets the first batch, worker 1 the second, ...)."""

    def __init__(self, spec: str, *, hidden: int | None = None, batch: int = 32):
        self.spec, self.hidden, self.batch, self.name = spec, hidden, batch, spec
        self._tasks: dict[int, TrainingTask] = {}
        self._task(0)  # TaskError now, with one line, rather than in the middle of a comparison

    def _task(self, seed: int) -> TrainingTask:
        if seed not in self._tasks:
            self._tasks[seed] = load_task(self.spec, seed=seed, hidden=self.hidden, batch=self.batch)
        self._current = self._tasks[seed]
        return self._current

    def make_model(self, seed: int) -> nn.Module:
        return copy.deepcopy(self._task(seed).model)

    def batches(self, workers, batch, gens):
        task = self._current
        if task.samples:
            return [lambda g=g: task.data(batch, g) for g in gens]
        stream: Iterator = task.batches(batch, gens[0])

        def take() -> Any:
            item = next(stream, None)
            if item is None:
                raise DataExhausted
            return item

        return [take] * workers

    def loss(self, model, batch):
        return self._current.loss(model, batch)

    def evaluate(self, model):
        return self._current.evaluation(model)


class DataExhausted(Exception):
    """A task's one-shot stream of batches ended: the run stops at that step."""


def as_compare_task(task: Any) -> CompareTask:
    return task if isinstance(task, CompareTask) else LegacyTask(task)
