"""What a training task is: a model, its data, its loss and (optionally) its evaluation.

See the package docstring (``lioncub_p2p.tasks``) for the contract a ``--task module:function``
function fulfils.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Sampler = Callable[[int, torch.Generator], Any]  # (batch size, generator) -> one batch
Loss = Callable[[nn.Module, Any], torch.Tensor]  # (model, batch) -> scalar loss
Evaluate = Callable[[nn.Module], "float | dict[str, float]"]


class TaskError(ValueError):
    """A task that cannot be loaded or does not keep the contract; the message is one line for the user
    (the command line prefixes it with ``--task NAME:``)."""


@dataclass
class TrainingTask:
    """One peer's task. ``data`` is an iterable of batches, or a sampler ``data(batch_size, generator)``."""

    model: nn.Module
    data: Iterable | Sampler
    loss: Loss
    evaluate: Evaluate | None = None
    name: str = "task"

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise TaskError(f"the model must be a torch.nn.Module, got {type(self.model).__name__}")
        if not any(p.requires_grad for p in self.model.parameters()):
            raise TaskError("the model has no trainable parameters")
        if not (callable(self.data) or isinstance(self.data, Iterable)):
            raise TaskError("the data must be an iterable of batches or a function "
                            f"(batch_size, generator) -> batch, got {type(self.data).__name__}")
        if not callable(self.loss):
            raise TaskError("the loss must be a function (model, batch) -> loss, "
                            f"got {type(self.loss).__name__}")
        if self.evaluate is not None and not callable(self.evaluate):
            raise TaskError("evaluate must be a function (model) -> float or dict, "
                            f"got {type(self.evaluate).__name__}")

    @property
    def samples(self) -> bool:
        """Whether ``data`` is a sampler (a callable that is not itself iterable)."""
        return callable(self.data) and not isinstance(self.data, Iterable)

    def batches(self, batch_size: int, generator: torch.Generator) -> Iterator:
        """Batches for this peer: drawn from the sampler with ``generator`` (each peer seeds its own), or
        taken from the iterable, starting it over when it ends (a DataLoader is one epoch per pass).
        A one-shot iterator (a generator) that ends simply ends the batches."""
        if self.samples:
            while True:
                yield self.data(batch_size, generator)
        while True:
            iterator = iter(self.data)
            empty = True
            for batch in iterator:
                empty = False
                yield batch
            if empty or iterator is self.data:  # nothing to start over
                return

    def evaluation(self, model: nn.Module | None = None) -> dict[str, float]:
        """The task's evaluation as named floats (``{}`` without one); a bare float is the test loss."""
        if self.evaluate is None:
            return {}
        model = model if model is not None else self.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                result = self.evaluate(model)
        finally:
            model.train(was_training)
        if isinstance(result, (int, float)) and not isinstance(result, bool):
            return {"loss": float(result)}
        if torch.is_tensor(result) and result.numel() == 1:
            return {"loss": float(result.item())}
        if isinstance(result, dict) and all(isinstance(k, str) for k in result):
            try:
                return {k: float(v) for k, v in result.items()}
            except (TypeError, ValueError):
                pass
        raise TaskError("evaluate must return a float (test loss) or a dict of named floats, "
                        f"got {type(result).__name__}")

    def checked_batches(self, batch_size: int) -> Callable[[torch.Generator], Iterator]:
        """Check the task on one batch now (before a peer joins a run), then hand out the batch stream.

        Returns ``batches(generator)``: a sampler's batches start with the generator's first draw (the
        check drew from a throwaway generator); an iterable's first batch is the one checked."""
        try:
            if self.samples:
                self.check(self.data(batch_size, torch.Generator().manual_seed(0)))
                return lambda generator: self.batches(batch_size, generator)
            stream = self.batches(batch_size, torch.Generator())
            first = next(stream, None)
        except TaskError:
            raise
        except Exception as e:
            raise TaskError(f"the data failed: {type(e).__name__}: {one_line(e)}") from e
        if first is None:
            raise TaskError("the data yields no batches")
        self.check(first)
        return lambda generator: itertools.chain([first], stream)

    def check(self, batch: Any) -> torch.Tensor:
        """The loss of one batch, checked to be a scalar that gradients flow from (before training starts)."""
        try:
            loss = self.loss(self.model, batch)
        except Exception as e:
            raise TaskError(f"the loss failed on a batch of the data: {type(e).__name__}: "
                            f"{one_line(e)}") from e
        if not torch.is_tensor(loss) or loss.numel() != 1 or not loss.is_floating_point():
            raise TaskError("the loss must return a scalar float tensor, got "
                            f"{type(loss).__name__}{list(loss.shape) if torch.is_tensor(loss) else ''}")
        if not loss.requires_grad:
            raise TaskError("no gradient flows from the loss to the model's parameters "
                            "(computed under torch.no_grad(), or detached?)")
        return loss


@dataclass(frozen=True)
class IntArg:
    """An integer argument a built-in task takes, and the values it accepts. A run's manifest sets it
    for every joiner (``task_args``), so its range is what a stranger's manifest may make a peer build."""

    low: int
    high: int
    multiple: int = 1
    multiple_of: str = ""  # what the multiple is, e.g. "its 4 attention heads"

    def describe(self) -> str:
        if self.multiple == 1:
            return f"an integer from {self.low} to {self.high}"
        return f"a multiple of {self.multiple_of or self.multiple} from {self.low} to {self.high}"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and self.low <= value <= self.high \
            and value % self.multiple == 0


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]
