"""Training tasks: what a volunteer trains, chosen with ``lioncub-train --task NAME|module:function``.

Built-in: ``digits`` (an MLP on scikit-learn's digits; needs ``pip install 'lioncub-p2p[sim]'``)
and ``byte-gpt`` (a byte-level GPT on the Python standard library's own source files).

Your own task is a function, ``--task mypackage.mymodule:make_task`` (importable: installed, or
in the folder you run from). It returns ``(model, data, loss)`` or ``(model, data, loss, evaluate)``
(or a ``TrainingTask``):

- ``model``: a ``torch.nn.Module``; every peer of a run must build the same architecture (the
  founder's parameters are what joiners download; a checkpoint or snapshot of another layout is
  refused);
- ``data``: either an iterable of batches (a list, a ``DataLoader``: started over when it ends; a
  generator: training stops when it ends), or a sampler ``data(batch_size, generator) -> batch``
  that draws with the given ``torch.Generator`` (each peer seeds its own, so peers draw different
  batches; ``batch_size`` is ``--batch``);
- ``loss``: ``loss(model, batch) -> scalar tensor`` that gradients flow from;
- ``evaluate`` (optional): ``evaluate(model) -> float`` (the test loss) or a dict of named floats
  (a ``"loss"`` entry is the test loss); run under ``torch.no_grad()`` with ``model.eval()``.

The function is called with the keyword arguments among ``seed`` (``--seed``, for the model's
initialization), ``batch`` (``--batch``) and ``hidden`` (``--hidden``, None unless given) that its
signature names (all of them if it takes ``**kwargs``). The task is checked on one batch before
the peer joins a run: a broken task stops with one line, not in the middle of a run.

A run's manifest can make a joiner train a built-in task only: a ``module:function`` task runs when
the peer's own user names it (``--task``, ``--trust-task``). Each built-in module declares the
arguments a manifest may set and their ranges (``ARGS``) and predicts its model's parameter count
without allocating it (``param_count``), so a stranger's manifest cannot make a peer build a huge model.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from .contract import IntArg, TaskError, TrainingTask, one_line

BUILTIN = {"digits": "lioncub_p2p.tasks.digits:digits", "byte-gpt": "lioncub_p2p.tasks.byte_gpt:byte_gpt"}

__all__ = ["BUILTIN", "IntArg", "TaskError", "TrainingTask", "builtin_args", "check_args", "load_task", "param_count"]


def _builtin(name: str) -> ModuleType:
    return importlib.import_module(BUILTIN[name].partition(":")[0])


def builtin_args(name: str) -> dict[str, IntArg]:
    """The arguments built-in task ``name`` takes (``hidden``), with the values each accepts."""
    return dict(_builtin(name).ARGS)


def _flag(key: str, value: Any) -> str:
    return f"--{key} {value}"


def check_args(name: str, values: Mapping[str, Any], where: Callable[[str, Any], str] = _flag) -> dict[str, Any]:
    """``values`` for built-in task ``name``, checked against what it declares; TaskError (one line,
    starting with ``where(key, value)``) for an argument it does not take or a value out of its range."""
    declared = builtin_args(name)
    for key, value in values.items():
        shown = where(key, value)
        if key not in declared:
            raise TaskError(f"{shown}: task {name} takes no argument {key!r} (it takes {', '.join(declared)})")
        if not declared[key].accepts(value):
            raise TaskError(f"{shown}: task {name} takes {key} as {declared[key].describe()}")
    return dict(values)


def param_count(name: str, **args: Any) -> int:
    """The parameter count of built-in task ``name``'s model built with ``args`` (checked first),
    computed without allocating it."""
    check_args(name, args)
    return _builtin(name).param_count(**args)


def load_task(spec: str, **options: Any) -> TrainingTask:
    """The task named ``spec`` (a built-in name, or ``module:function``), built with ``options``.

    Raises TaskError with a one-line message for every way a spec can be wrong."""
    target = BUILTIN.get(spec, spec)
    if spec in BUILTIN and options.get("hidden") is not None:
        check_args(spec, {"hidden": options["hidden"]})
    module_name, colon, function_name = target.partition(":")
    if not colon or not module_name or not function_name:
        raise TaskError(f"--task {spec!r}: not a built-in task ({', '.join(BUILTIN)}) nor module:function "
                        f"(e.g. --task mytask:make_task for make_task() in mytask.py)")
    if os.getcwd() not in sys.path and "" not in sys.path:  # an installed command's path has no current folder
        sys.path.append(os.getcwd())  # the user's own module, in the folder they run from (after installed ones)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise TaskError(f"--task {spec}: no module named {e.name!r} on the Python path; run from the folder "
                            f"that holds {module_name.replace('.', '/')}.py or add it to PYTHONPATH") from None
        raise TaskError(f"--task {spec}: importing {module_name} failed: {e}") from None
    except TaskError:
        raise
    except Exception as e:
        raise TaskError(f"--task {spec}: importing {module_name} failed: {type(e).__name__}: {one_line(e)}") from None
    function = getattr(module, function_name, None)
    if function is None:
        raise TaskError(f"--task {spec}: module {module_name} has no function {function_name!r}")
    if not callable(function):
        raise TaskError(f"--task {spec}: {module_name}.{function_name} is a {type(function).__name__}, not a function")
    try:
        result = function(**_accepted(function, options))
    except TaskError:
        raise
    except Exception as e:
        raise TaskError(f"--task {spec}: {function_name}() raised {type(e).__name__}: {one_line(e)}") from None
    name = spec if spec in BUILTIN else f"{module_name}:{function_name}"
    if isinstance(result, TrainingTask):
        return result
    if not isinstance(result, (tuple, list)) or len(result) not in (3, 4):
        raise TaskError(f"--task {spec}: {function_name}() must return (model, data, loss) or "
                        f"(model, data, loss, evaluate), got {_describe(result)}")
    try:
        return TrainingTask(*result, name=name)
    except TaskError as e:
        raise TaskError(f"--task {spec}: {e}") from None


def _accepted(function: Any, options: dict[str, Any]) -> dict[str, Any]:
    """The options a function's signature names (all of them if it takes **kwargs)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(options)
    return {k: v for k, v in options.items() if k in parameters}


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"an object of type {type(value).__name__}"
