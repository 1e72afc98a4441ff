"""Imports point down (docs/architecture.md): ops <- codecs <- allreduce <- swarm <- tasks <- sim / cli,
and the command-line tools and the simulator never import each other. A volunteer's trainer runs
on the core install: no scikit-learn, matplotlib or simulator."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Layer of each part of the package (its first component below lioncub_p2p; "" is the package's own
# __init__, which exports LionCub and MomentumSchedule). A module may import its own part and any part
# of a lower layer, nothing else.
LAYERS = {
    "ops": 0, "wire": 0, "identity": 0, "aio": 0, "failpoints": 0,
    "codecs": 1, "codecs_delta": 1,
    "optim": 2, "momentum": 2, "allreduce": 2,
    "": 3, "cluster": 3,
    "swarm": 4, "testing": 4,
    "tasks": 5, "trainer_rounds": 5,
    "cli": 6, "sim": 6,
}


def _module_name(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _is_module(name: str, root: Path) -> bool:
    relative = Path(*name.split("."))
    return (root / relative).with_suffix(".py").exists() or (root / relative / "__init__.py").exists()


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every lioncub_p2p module a file imports, at any depth of the file."""
    name, is_package = _module_name(path, root)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from . import ops` imports the module lioncub_p2p.ops
                full = f"{target}.{alias.name}"
                found.append((node.lineno, full if _is_module(full, root) else target))
    return [(line, target) for line, target in found if target.split(".")[0] == "lioncub_p2p"]


def part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layering_violations(root: Path = ROOT) -> list[str]:
    problems = []
    for path in sorted((root / "lioncub_p2p").rglob("*.py")):
        where = path.relative_to(root)
        source = part(_module_name(path, root)[0])
        if source not in LAYERS:
            problems.append(f"{where}: part {source!r} has no layer in tests/test_imports.py LAYERS "
                            f"(and docs/architecture.md)")
            continue
        for line, target in imports_of(path, root):
            dest = part(target)
            if dest == source:
                continue
            if dest not in LAYERS:
                problems.append(f"{where}:{line} imports {target}, whose part has no layer")
            elif LAYERS[dest] >= LAYERS[source]:
                problems.append(f"{where}:{line} imports {target}: {source or 'lioncub_p2p'} "
                                f"(layer {LAYERS[source]}) may not import {dest or 'lioncub_p2p'} (layer {LAYERS[dest]})")
    return problems


def test_imports_point_down_and_cli_and_sim_stay_apart():
    problems = layering_violations()
    assert not problems, "imports against the layering:\n" + "\n".join(problems)


def test_the_checker_sees_upward_and_sideways_imports(tmp_path):
    """The checker itself: a planted cli -> sim import (relative, inside a function) and a swarm -> cli
    import are reported; a downward import is not."""
    package = tmp_path / "lioncub_p2p"
    for folder in ("cli", "sim", "swarm"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "sim" / "tasks.py").write_text("X = 1\n")
    (package / "cli" / "train.py").write_text("def main():\n    from ..sim import tasks\n    from ..swarm import x\n")
    (package / "swarm" / "peer.py").write_text("import lioncub_p2p.cli.train\n")
    problems = layering_violations(tmp_path)
    assert len(problems) == 2, problems
    assert "cli/train.py:2 imports lioncub_p2p.sim.tasks" in problems[0]
    assert "swarm/peer.py:1 imports lioncub_p2p.cli.train" in problems[1]


BLOCK_OPTIONAL = textwrap.dedent('''
    import importlib.abc, importlib.machinery, sys

    class Missing(importlib.abc.Loader):
        def create_module(self, spec):
            raise ModuleNotFoundError(f"No module named {spec.name!r} (blocked)", name=spec.name)

        def exec_module(self, module):
            pass

    class CoreInstallOnly(importlib.abc.MetaPathFinder):
        """What a plain `pip install lioncub-p2p` lacks: the [sim] extra and the simulator's own modules.
        (A spec whose loader fails, not an exception here: torch probes for sklearn with find_spec.)"""
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("sklearn", "matplotlib") or name.startswith("lioncub_p2p.sim"):
                return importlib.machinery.ModuleSpec(name, Missing())
            return None

    sys.meta_path.insert(0, CoreInstallOnly())
''')


@pytest.mark.slow
def test_trainer_runs_on_the_core_install(tmp_path):
    """With scikit-learn, matplotlib and lioncub_p2p.sim unimportable: every CLI module imports,
    --task digits stops with one line naming the extra to install, and --task byte-gpt trains, without
    importing torch._dynamo (torch's optimizer guard imports it lazily: 1.5-2 s of CPU per trainer)."""
    script = BLOCK_OPTIONAL + textwrap.dedent('''
        import lioncub_p2p.cli.train, lioncub_p2p.cli.coordinator, lioncub_p2p.cli.preflight
        import lioncub_p2p.cli.baseline, lioncub_p2p.cli.plot, lioncub_p2p.tasks
        try:
            lioncub_p2p.cli.train.main(["--task", "digits", "--steps", "1"])
        except SystemExit as e:
            print("DIGITS:", e.code)
        lioncub_p2p.cli.train.main(["--task", "byte-gpt", "--hidden", "16", "--batch", "4", "--steps", "3",
                                    "--run-id", "core", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--quiet"])
        print("SIM LOADED:", sorted(m for m in sys.modules if m.startswith(("lioncub_p2p.sim", "sklearn"))))
        print("DYNAMO LOADED:", "torch._dynamo" in sys.modules)
    ''')
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    digits = [line for line in done.stdout.splitlines() if line.startswith("DIGITS:")]
    assert len(digits) == 1 and "pip install 'lioncub-p2p[sim]'" in digits[0] and "scikit-learn" in digits[0]
    assert "finished at step 3: test loss" in done.stdout
    assert "SIM LOADED: []" in done.stdout
    assert "DYNAMO LOADED: False" in done.stdout
    assert "Traceback" not in done.stderr


def _optimizer_attributes(path: Path) -> set[str]:
    """Attributes read of ``self.optimizer`` in a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "optimizer" and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "self"):
            found.add(node.attr)
    return found


def test_the_vote_pipeline_sees_the_optimizer_only_through_its_training_view():
    """The round pipeline reads only what ``optim.TrainingView`` declares (the whole state is
    snapshot.py's); a new read of LionCub's internals there must be added to the view on purpose."""
    from lioncub_p2p.optim import LionCub, TrainingView

    declared = {name for name in vars(TrainingView) if not name.startswith("_")}
    assert declared <= set(dir(LionCub))  # LionCub is such a view
    used = _optimizer_attributes(ROOT / "lioncub_p2p" / "swarm" / "pipeline.py")
    assert used and used <= declared, sorted(used - declared)


def file_circles(root: Path = ROOT) -> list[list[str]]:
    """Modules that import each other, directly or around a loop, counting imports anywhere in a file (a
    lazy import inside a function is still a dependency): each circle once, as a list of module names.
    A package's ``__init__`` importing its own modules is left out (that is how packages export)."""
    graph: dict[str, set[str]] = {}
    for path in (root / "lioncub_p2p").rglob("*.py"):
        name, is_package = _module_name(path, root)
        if is_package:
            continue
        graph[name] = {target for _, target in imports_of(path, root) if target != name}
    circles, done = [], set()
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start and len(trail) > 1:
                    circle = sorted(trail)
                    if tuple(circle) not in done:
                        done.add(tuple(circle))
                        circles.append(trail)
                elif nxt not in trail and nxt > start and len(trail) < 6:
                    stack.append((nxt, trail + [nxt]))
    return circles


def test_no_two_modules_import_each_other():
    """One concept, one home, arrows one way: no file circle, lazy imports included (there were two:
    cli/train.py and cli/baseline.py, sim/inprocess.py and sim/variants.py)."""
    assert file_circles() == []


def test_the_circle_finder_sees_a_lazy_circle(tmp_path):
    package = tmp_path / "lioncub_p2p"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .a import g\n")
    (package / "c.py").write_text("from . import a\n")
    assert file_circles(tmp_path) == [["lioncub_p2p.a", "lioncub_p2p.b"]]


def test_every_package_the_library_imports_is_declared():
    """A package imported anywhere in lioncub_p2p is a dependency of pyproject.toml (core or an extra),
    not something that happens to come with another one (base58, cryptography, msgpack and llvmlite
    were imported and never declared)."""
    import importlib.metadata
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    declared = {re.split(r"[<>=!\[ ;]", d, maxsplit=1)[0].lower().replace("_", "-") for d in specs}
    providers = importlib.metadata.packages_distributions()
    stdlib = set(sys.stdlib_module_names)
    missing = set()
    for path in (ROOT / "lioncub_p2p").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top in stdlib or top == "lioncub_p2p" or top not in providers:
                    continue  # not installed here (an optional accelerator): the extras' business
                dists = {d.lower().replace("_", "-") for d in providers[top]}
                if not dists & declared:
                    missing.add(f"{top} ({', '.join(sorted(dists))}) in {path.relative_to(ROOT)}")
    assert not missing, sorted(missing)
