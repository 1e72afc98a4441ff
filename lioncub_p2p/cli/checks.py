"""Checks of a trainer's settings that run before it joins a run: a mistake found at step 50, or
after a download from the swarm, costs the volunteer (and the group) far more than one line now."""
from __future__ import annotations

import os
from pathlib import Path

from ..codecs import result_codec, upload_codec
from ..optim import LionCub
from ..swarm import checkpoint, snapshot
from .common import UsageError

VOTE_UPLOADS = "sign (1 bit) or l1:BITS (BITS from 2 to 8)"
VOTE_RESULTS = ("majority", "ternary", "mean")


def check_run_id(run_id: str) -> str:
    """Run ids name DHT keys, whose parts dots separate."""
    if not run_id or "." in run_id or any(c.isspace() for c in run_id):
        suggestion = "-".join(run_id.replace(".", " ").split()) or "my-run"
        raise UsageError(f"--run-id {run_id!r}: a run id is a name without dots or spaces; try --run-id {suggestion}")
    return run_id


def check_codecs(upload: str, result: str) -> None:
    """A vote's upload and result encodings (bf16 and the averages belong to momentum averaging)."""
    name = upload.partition(":")[0]
    if upload != "sign" and name != "l1":
        raise UsageError(f"--upload {upload}: not a vote encoding; use {VOTE_UPLOADS}")
    try:
        upload_codec(upload)
    except ValueError as e:
        reason = "the bits after 'l1:' must be a whole number" if "invalid literal" in str(e) else str(e)
        raise UsageError(f"--upload {upload}: {reason}; use {VOTE_UPLOADS}") from None
    if result not in VOTE_RESULTS:
        raise UsageError(f"--result {result}: not a vote result; use one of {' | '.join(VOTE_RESULTS)}")
    result_codec(result)


def check_writable_dir(flag: str, path: str) -> Path:
    """Create the folder if needed and write a probe file in it (as root, permissions do not tell)."""
    folder = Path(path)
    probe = folder / f".lioncub-write-check.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"{flag} {path} is not a folder this process can write ({e.strerror or e}); "
                         f"choose another folder or fix its permissions") from None
    return folder


def check_writable_file(flag: str, path: str) -> None:
    """The file can be appended to, or created in its folder; nothing is created or changed here."""
    target = Path(path)
    try:
        if target.exists():
            with open(target, "ab"):
                pass
            return
    except OSError as e:
        raise UsageError(f"{flag} {path} cannot be written ({e.strerror or e}); choose another path") from None
    folder = target.parent
    probe = folder / f".lioncub-write-check.{os.getpid()}"
    try:
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create a file in {folder} ({e.strerror or e}); choose another "
                         f"path") from None


def check_checkpoint_fits(directory: str, optimizer: LionCub, hint: str, run_id: str | None = None) -> int | None:
    """The step of the checkpoint in ``directory`` if it fits this model (None if there is none).

    The same checks ``checkpoint.restore`` makes, without loading anything: a checkpoint of another
    model stops the trainer here, before it joins a run, not after."""
    path = Path(directory) / checkpoint.FILENAME
    if not path.exists():
        return None
    try:
        blob = path.read_bytes()
        header, offset = snapshot.read_header(blob)
        entries = [(n, d, list(s)) for n, d, s in header["tensors"]]
    except (OSError, snapshot.SnapshotError, KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{path} is not a readable checkpoint ({e}); move it away or choose another "
                         f"--checkpoint-dir") from None
    try:
        checkpoint.check_run(path, header, run_id)
    except snapshot.SnapshotError as e:
        raise UsageError(str(e)) from None
    layout = snapshot.Layout.of(optimizer)
    if entries != layout.entries:
        theirs, ours = _params(entries), _params(layout.entries)
        raise UsageError(f"{path} is a checkpoint of another model ({theirs[0]} tensors, {theirs[1]:,} parameters; "
                         f"this one: {ours[0]} tensors, {ours[1]:,}); use the {hint} it was made with, or another "
                         f"--checkpoint-dir")
    try:
        expected = snapshot.body_bytes(header, layout)
    except snapshot.SnapshotError as e:
        raise UsageError(f"{path} is not a readable checkpoint ({e}); move it away or choose another "
                         f"--checkpoint-dir") from None
    if len(blob) != offset + expected:
        raise UsageError(f"{path} is truncated ({len(blob) - offset} of {expected} bytes); move it away or "
                         f"choose another --checkpoint-dir")
    return header["step"]


def _params(entries: list) -> tuple[int, int]:
    """(parameter tensors, parameter count) of a snapshot's tensor list."""
    count = tensors = 0
    for name, _, shape in entries:
        if str(name).startswith("param:"):
            tensors += 1
            n = 1
            for d in shape:
                n *= int(d)
            count += n
    return tensors, count
