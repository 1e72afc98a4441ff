"""A peer's training state as bytes: parameters, momenta and step. No pickle, ever.

Layout: ``MAGIC | u32 header length | JSON header | parameter bytes | momentum bytes | in-flight
update bytes``; without the momentum bytes when the header says ``"momenta": false``
(``without_momenta``: for a peer that keeps its own, as a repair or a skip ahead does, half the
bytes). The header lists each tensor's name, dtype and shape; the receiver accepts a snapshot only
if that list equals its own model's exactly, so a peer cannot make it allocate or reshape anything
unexpected. With overlapped rounds the update of the vote in flight is part of the state (header
``pending``: its dtype, ``uint8`` packed or ``float32`` values, sized by the vote buffer). Parameters
and that update are identical on every peer at the same step (the digest covers both); momenta are
each peer's own.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import torch

from ..ops import packed_size
from ..optim import LionCub

MAGIC = b"LCUBSNAP"
FORMAT = 1
MAX_HEADER_BYTES = 1 << 20
MAX_STEP = 1 << 53  # steps travel as uint64: a step near 2**64 would overflow them a few steps on
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PENDING_DTYPES = {"uint8": torch.uint8, "float32": torch.float32}


class SnapshotError(ValueError):
    """A snapshot that does not fit this model (or is corrupt)."""


@dataclass
class Layout:
    """Names, dtypes and shapes of the tensors a snapshot of this optimizer holds, in order."""

    entries: list[tuple[str, str, list[int]]]  # (name, dtype, shape); parameters first, then momenta

    @classmethod
    def of(cls, optimizer: LionCub) -> "Layout":
        entries = []
        for kind in ("param", "momentum"):
            for slot in optimizer.slots:
                dtype = str(slot.param.dtype).removeprefix("torch.")
                entries.append((f"{kind}:{slot.name}", dtype, list(slot.param.shape)))
        return cls(entries)

    def digest(self) -> str:
        """32 hex digits identifying the layout: peers whose models differ in any name, dtype or shape differ here."""
        body = json.dumps([list(e) for e in self.entries], separators=(",", ":")).encode()
        return hashlib.blake2b(body, digest_size=16).hexdigest()

    def param_count(self) -> int:
        return sum(torch.Size(shape).numel() for name, _, shape in self.entries if name.startswith("param:"))

    def nbytes(self, kind: str | None = None) -> int:
        total = 0
        for name, dtype, shape in self.entries:
            if kind is None or name.startswith(kind + ":"):
                total += torch.Size(shape).numel() * DTYPES[dtype].itemsize
        return total


def _tensors(optimizer: LionCub) -> list[torch.Tensor]:
    return [s.param.detach() for s in optimizer.slots] + [m for _, m in optimizer.momentum_buffers()]


def _raw(t: torch.Tensor) -> bytes:
    # clone, not contiguous(): a strided single element counts as contiguous yet cannot be viewed as bytes
    flat = t.detach().cpu().reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy().tobytes()


def params_digest(optimizer: LionCub) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for slot in optimizer.slots:
        h.update(_raw(slot.param))
    return h.digest()


def state_tag(optimizer: LionCub, *, full: bool = False, samples: int = 1 << 16) -> bytes:
    """A 16-byte digest of the parameters: all bytes when ``full``, else ~``samples`` strided
    elements (cheap every step; any divergence that touches a whole part of the buffer shows)."""
    if full:
        return params_digest(optimizer)
    total = sum(s.param.numel() for s in optimizer.slots)
    stride = max(1, total // samples)
    h = hashlib.blake2b(digest_size=16)
    for slot in optimizer.slots:
        h.update(_raw(slot.param.detach().reshape(-1)[::stride]))
    return h.digest()


def encode(optimizer: LionCub, *, run: str | None = None) -> tuple[bytes, bytes]:
    """(snapshot bytes, digest of the parameters and the in-flight update). With a round in flight
    this waits for its update. ``run``: the run id a checkpoint belongs to (``checkpoint.py``)."""
    pending = optimizer.in_flight_update()
    if pending is not None:
        optimizer.check_update(pending)
    meta = {"format": FORMAT, "step": optimizer.step_count, "tensors": Layout.of(optimizer).entries}
    if run is not None:
        meta["run"] = run
    if pending is not None:
        meta["pending"] = str(pending.dtype).removeprefix("torch.")
    header = json.dumps(meta, separators=(",", ":")).encode()
    tensors = _tensors(optimizer)
    nparams = len(optimizer.slots)
    digest = hashlib.blake2b(digest_size=16)
    body = []
    for i, t in enumerate(tensors):
        raw = _raw(t)
        if i < nparams:
            digest.update(raw)
        body.append(raw)
    if pending is not None:
        body.append(_raw(pending))
        digest.update(body[-1])
    return MAGIC + struct.pack("<I", len(header)) + header + b"".join(body), digest.digest()


def body_bytes(header: dict, layout: Layout) -> int:
    """Bytes after the header of a snapshot whose header is ``header`` (raises SnapshotError)."""
    return _tensor_bytes(header, layout) + _pending_bytes(header, layout)[1]


def _has_momenta(header: dict) -> bool:
    momenta = header.get("momenta", True)
    if not isinstance(momenta, bool):
        raise SnapshotError(f"snapshot header: momenta must be true or false, got {momenta!r}")
    return momenta


def _tensor_bytes(header: dict, layout: Layout) -> int:
    """Bytes of the tensor section: parameters, and momenta unless the snapshot left them out."""
    return layout.nbytes() if _has_momenta(header) else layout.nbytes("param")


def without_momenta(blob: bytes | bytearray) -> bytes:
    """The same snapshot without its momenta (same step, same digest): what a peer that keeps its own
    momenta downloads. Momenta are each peer's own; the parameters and the in-flight update are the
    group's, and only they must be equal after a repair."""
    header, offset = read_header(blob)
    layout = _layout_of(header)
    if not _has_momenta(header):
        return bytes(blob)
    params, total = layout.nbytes("param"), layout.nbytes()
    _, pending = _pending_bytes(header, layout)
    if len(blob) != offset + total + pending:
        raise SnapshotError(f"snapshot body has {len(blob) - offset} bytes, expected {total + pending}")
    meta = json.dumps(dict(header, momenta=False), separators=(",", ":")).encode()
    return b"".join((MAGIC, struct.pack("<I", len(meta)), meta, blob[offset : offset + params],
                     blob[offset + total :]))


def _layout_of(header: dict) -> Layout:
    try:
        return Layout([tuple(e) for e in header["tensors"]])
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"unreadable tensor list: {e}") from e


def _pending_bytes(header: dict, layout: Layout) -> tuple[torch.dtype | None, int]:
    """(dtype, bytes) of the in-flight update a snapshot header announces; (None, 0) for none."""
    name = header.get("pending")
    if name is None:
        return None, 0
    if not isinstance(name, str) or name not in PENDING_DTYPES:
        raise SnapshotError(f"unsupported in-flight update dtype {name!r}")
    packed = sum(packed_size(torch.Size(shape).numel()) for n, _, shape in layout.entries if n.startswith("param:"))
    return PENDING_DTYPES[name], packed if name == "uint8" else packed * 8 * 4


def read_header(blob: bytes | bytearray) -> tuple[dict, int]:
    """(header, body offset) of a snapshot; raises SnapshotError."""
    if len(blob) < len(MAGIC) + 4 or blob[: len(MAGIC)] != MAGIC:
        raise SnapshotError("not a lioncub snapshot")
    (length,) = struct.unpack("<I", blob[len(MAGIC) : len(MAGIC) + 4])
    if length > MAX_HEADER_BYTES or len(blob) < len(MAGIC) + 4 + length:
        raise SnapshotError(f"snapshot header of {length} bytes is too long or truncated")
    try:
        header = json.loads(bytes(blob[len(MAGIC) + 4 : len(MAGIC) + 4 + length]))
        if header["format"] != FORMAT:
            raise SnapshotError(f"unsupported snapshot format {header.get('format')}")
        if type(header["step"]) is not int or not 0 <= header["step"] < MAX_STEP:  # a bool is no step
            raise SnapshotError(f"snapshot step {header['step']!r} is not a step")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:  # nested [[[... recurses
        raise SnapshotError(f"unreadable snapshot header: {type(e).__name__}: {str(e)[:100]}") from e
    return header, len(MAGIC) + 4 + length


def step_and_params_digest(blob: bytes | bytearray) -> tuple[int, bytes]:
    """(step, digest of the parameter section) of a snapshot, without a model: at the same step every
    peer of a healthy swarm has the same digest (the one ``encode`` returns)."""
    header, offset = read_header(blob)
    layout = _layout_of(header)
    try:
        size, total = layout.nbytes("param"), _tensor_bytes(header, layout)
        _, pending = _pending_bytes(header, layout)
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"unreadable tensor list: {e}") from e
    if len(blob) < offset + total + pending:
        raise SnapshotError(f"snapshot truncated: {len(blob) - offset} of {total + pending} bytes")
    return header["step"], _digest(blob, offset, size, total, pending)


def _digest(blob: bytes | bytearray, offset: int, param_bytes: int, body_bytes: int, pending_bytes: int) -> bytes:
    """What ``encode`` returns as the digest: of the parameter section and the in-flight update."""
    digest = hashlib.blake2b(bytes(blob[offset : offset + param_bytes]), digest_size=16)
    digest.update(bytes(blob[offset + body_bytes : offset + body_bytes + pending_bytes]))
    return digest.digest()


def max_size(optimizer: LionCub) -> int:
    """An upper bound on this model's snapshot size, to bound a download before it starts."""
    return len(MAGIC) + 4 + MAX_HEADER_BYTES + Layout.of(optimizer).nbytes() + optimizer.buffer_bytes * 8 * 4


@dataclass
class _Checked:
    header: dict
    offset: int  # where the tensor bytes begin
    pending: torch.Tensor | None  # the in-flight update it carries


def check(optimizer: LionCub, blob: bytes | bytearray, *, expect_digest: bytes | None = None,
          expect_step: int | None = None) -> _Checked:
    """Everything ``load`` checks, without touching the model (raises SnapshotError): run on each
    donor's snapshot as it completes, so a bad one is that donor's fault and the next donor is asked.
    ``expect_step``: the step the donor said it serves (the header's must be the same)."""
    header, offset = read_header(blob)
    if expect_step is not None and header["step"] != expect_step:
        raise SnapshotError(f"snapshot says step {header['step']}, its donor said {expect_step}")
    layout = Layout.of(optimizer)
    try:
        entries = [(n, d, list(s)) for n, d, s in header["tensors"]] if isinstance(header["tensors"], list) else None
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"unreadable tensor list: {type(e).__name__}: {str(e)[:100]}") from e
    if entries != layout.entries:
        raise SnapshotError("snapshot tensors do not match this model (names, dtypes or shapes differ)")
    pending_dtype, pending_bytes = _pending_bytes(header, layout)
    total = _tensor_bytes(header, layout)
    if len(blob) != offset + total + pending_bytes:
        raise SnapshotError(f"snapshot body has {len(blob) - offset} bytes, expected {total + pending_bytes}")
    if expect_digest is not None and _digest(blob, offset, layout.nbytes("param"), total, pending_bytes) != expect_digest:
        raise SnapshotError("parameter digest mismatch")
    pending = None if pending_dtype is None else \
        torch.frombuffer(bytearray(memoryview(blob)[offset + total :]), dtype=pending_dtype).clone()
    if pending is not None and pending.is_floating_point() and not bool(torch.isfinite(pending).all()):
        raise SnapshotError("the in-flight update it carries is not finite")
    _check_finite_momenta(blob, offset, layout, total)
    return _Checked(header, offset, pending)


def _check_finite_momenta(blob: bytes | bytearray, offset: int, layout: Layout, total: int) -> None:
    """Momenta are outside the digest (each peer's own), so a donor could send NaN there with the group's
    parameters: the joiner's votes and momentum syncs would be garbage for good (an fp8 sync refuses a
    non-finite value, a bf16 one averages NaN back in)."""
    position = offset + layout.nbytes("param")
    view = memoryview(blob)
    for name, dtype, shape in layout.entries:
        if not name.startswith("momentum:") or position >= offset + total:
            continue
        size = torch.Size(shape).numel() * DTYPES[dtype].itemsize
        values = torch.frombuffer(bytearray(view[position : position + size]), dtype=DTYPES[dtype]) if size else None
        if values is not None and not bool(torch.isfinite(values).all()):
            raise SnapshotError(f"its momentum {name[len('momentum:'):]!r} is not finite")
        position += size


def load(optimizer: LionCub, blob: bytes | bytearray, *, expect_digest: bytes | None = None,
         expect_step: int | None = None) -> int:
    """Copy a snapshot into the optimizer's parameters and momenta (kept as they are when the snapshot
    has none); returns its step.

    Checks everything before touching the model (``check``): a rejected snapshot leaves the state as it was."""
    checked = check(optimizer, blob, expect_digest=expect_digest, expect_step=expect_step)
    header, offset, pending = checked.header, checked.offset, checked.pending
    layout = Layout.of(optimizer)
    copied = layout.entries if _has_momenta(header) else layout.entries[: len(optimizer.slots)]  # params first
    view = memoryview(blob)
    with torch.no_grad():
        for t, (name, dtype, shape) in zip(_tensors(optimizer), copied):
            size = t.numel() * t.element_size()
            src = torch.frombuffer(bytearray(view[offset : offset + size]), dtype=DTYPES[dtype]).view(shape) \
                if size else torch.empty(shape, dtype=DTYPES[dtype])
            t.copy_(src)
            offset += size
    for group in optimizer.param_groups:
        group["step"] = header["step"]
    optimizer.restore_in_flight(pending)
    return header["step"]
