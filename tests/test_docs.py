"""The docs name what the code has: every module in docs/architecture.md, every wire message in
docs/protocol.md, and no project file cites documents outside this repository."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lioncub_p2p"


def test_every_module_is_in_the_architecture_doc():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py" or path.name.endswith("_pb2.py"):
            continue
        if not re.search(rf"(?<![\w.]){re.escape(path.name)}\b", doc):
            missing.append(str(path.relative_to(ROOT)))
    for package in sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        if f"{package.name}/" not in doc:
            missing.append(f"{package.relative_to(ROOT)}/")
    assert not missing, f"docs/architecture.md does not list: {missing}"


def test_every_wire_message_is_in_the_protocol_doc():
    doc = (ROOT / "docs" / "protocol.md").read_text()
    messages = re.findall(r"^message (\w+)", (ROOT / "proto" / "lioncub.proto").read_text(), flags=re.M)
    assert len(messages) >= 8, messages
    missing = [m for m in messages if not re.search(rf"\b{m}\b", doc)]
    assert not missing, f"docs/protocol.md does not describe: {missing}"


def test_no_project_file_cites_documents_outside_the_repository():
    offenders = []
    for path in ROOT.rglob("*"):
        if any(part in (".git", ".venv", "runs", "__pycache__") for part in path.parts) or not path.is_file():
            continue
        if path.suffix in (".py", ".md", ".sh", ".yml", ".yaml", ".toml", ".proto") or path.name == "run":
            if path == Path(__file__):
                continue
            if re.search(r"shared/docs|\.\./shared", path.read_text(errors="ignore")):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders
