"""Serving and downloading training state between peers, chunked and resumable.

A donor serves at most ``max_uploads`` downloads at once and answers "busy" beyond that, so
newcomers spread over donors; only admitted requests count (a stream that says nothing within
``FIRST_FRAME_S``, or is refused, never holds a download slot), and streams are capped per peer
before anything is read (``wire/gate.py``). A download that loses its donor resumes at the same
byte from another donor whose snapshot has the same step and parameter digest; a donor that moved
on to a newer step sends its own snapshot from the start instead (a training swarm does not wait
for a newcomer).
"""
from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from typing import Callable

from hivemind.p2p import P2P, PeerID

from .. import failpoints
from ..allreduce.admission import OPEN, Admission
from ..wire import PROTOCOL_VERSION, WireError, close_after_reply, pb, read_frame, write_frame
from ..wire.gate import StreamGate, guard
from . import snapshot
from .errors import SwarmError

logger = logging.getLogger(__name__)

STATE_PROTOCOL = "lioncub/state/1"
CHUNK_BYTES = 256 << 10
FIRST_FRAME_S = 5.0
STALL_S = 30.0  # a donor that sends no chunk for this long is left for the next one (the download resumes)
FIRST_CHUNK_S = 90.0  # ...and its first chunk: it may wait up to its wait_timeout (60 s) for the step asked for
FAR_STEPS = 1000  # a request for a step further past this donor's is refused at once, not waited on
SAME_DONOR_RETRIES = 1  # a donor whose stream broke after sending something is asked to resume once more
FRESH_WAIT_S = 10.0  # how long a new download waits for the donor's current step before taking an older snapshot
MIN_RATE = 125_000  # bytes/s (1 Mbit/s): the slowest link a whole state download is given time for
SLOW_DONOR_S = 20.0  # a donor whose chunks average under a quarter of MIN_RATE over this long is left
DIGEST_BYTES = 16  # ``snapshot.params_digest``
SERVE_SLACK_S = 30.0  # a served download may take its bytes' time at MIN_RATE plus this, then it is ended


def download_bound(max_bytes: int, wait_s: float) -> float:
    """Seconds a state download may take: ``wait_s`` (donors reaching the step, busy ones, retries)
    plus the snapshot's transfer at ``MIN_RATE``. A fixed bound failed every download of a state
    larger than that bound's worth of the link (22 MB at 1 Mbit/s needs 176 s; the bound was 120 s)."""
    return wait_s + max_bytes / MIN_RATE


class StateTransferError(SwarmError):
    """A state download that failed (joining: one line for the volunteer; a repair logs it and goes on)."""


class SlowDonor(StateTransferError):
    """A donor that sends, but far under ``MIN_RATE``: not asked again in this download."""


class StateServer:
    """Hands this peer's latest snapshot to peers that ask for a step it has reached.

    The training thread encodes snapshots (``offer``) only when someone waits for one
    (``wanted_step``), at a step boundary, so a served state is always consistent. A ``provider``
    (called in a worker thread) covers a peer that is not stepping: it returns (step, blob, digest)
    of the state between steps, or None while a step is in progress or the step is too early."""

    def __init__(self, p2p: P2P, run_id: str, *, max_uploads: int = 2, wait_timeout: float = 60.0,
                 provider: Callable[[int], tuple[int, bytes, bytes] | None] | None = None,
                 admission: Admission = OPEN, current_step: Callable[[], int] | None = None,
                 is_member: Callable[[str], bool] | None = None):
        self.p2p, self.run_id = p2p, run_id.encode()
        self.max_uploads, self.wait_timeout = max_uploads, wait_timeout
        self._uploads = 0
        self._snapshot: tuple[int, bytes, bytes] | None = None  # step, blob, params digest
        self._lean: tuple[int, bytes, bytes] | None = None  # step, params digest, that snapshot without momenta
        self._pending: dict[int, int] = {}  # min_step -> waiting requests
        self._lock = threading.Lock()
        self._offered: asyncio.Condition | None = None
        self.provider = provider
        self.current_step = current_step  # this peer's step: a new download gets that state, not an older cached one
        self.admission = admission
        self.serving = True  # False while this peer holds no state a round confirmed: refuse at once
        self.holds_state = True  # ...but a request naming the exact digest it wants is served if held
        # streams before admission: 2 per peer, 16 in all; a stranger's also 2 per network address (members
        # of this peer's groups behind one NAT still download side by side); a download holds its stream,
        # busy ones end at once
        self.gate = StreamGate("state", per_peer=2, stranger_per_peer=2, strangers=16, total=16,
                               stranger_per_address=2, is_member=is_member)

    async def start(self) -> None:
        self._offered = asyncio.Condition()
        await self.p2p.add_binary_stream_handler(STATE_PROTOCOL, guard(self.gate, self._on_stream))

    @property
    def uploading(self) -> bool:
        """Whether a download from this peer is under way."""
        return self._uploads > 0

    def wanted_step(self) -> int | None:
        """The lowest step someone waits for and the current snapshot does not satisfy."""
        with self._lock:
            have = self._snapshot[0] if self._snapshot else -1
            waiting = [s for s, count in self._pending.items() if count and s > have]
            return min(waiting) if waiting else None

    def forget(self) -> None:
        """The state changed between steps (a flush, a download): the cached snapshot no longer holds it."""
        with self._lock:
            self._snapshot = self._lean = None

    async def offer(self, step: int, blob: bytes, digest: bytes) -> None:
        with self._lock:
            self._snapshot = (step, blob, digest)
        async with self._offered:
            self._offered.notify_all()

    async def _wait_snapshot(self, min_step: int, fresh: bool = False) -> tuple[int, bytes, bytes]:
        """A snapshot of ``min_step`` or later; ``fresh`` (a new download, not a resumed one): of this
        peer's current step if one comes within ``FRESH_WAIT_S``. A snapshot cached for an earlier
        download was served 16 steps old to a 1 Mbit/s peer, which then was still behind and downloaded
        again (minutes)."""
        want = max(min_step, self.current_step()) if fresh and self.current_step is not None else min_step
        started = time.monotonic()

        def ready(snap: tuple[int, bytes, bytes] | None) -> bool:
            have = snap[0] if snap is not None else -1
            return have >= want or (have >= min_step and time.monotonic() - started > FRESH_WAIT_S)

        with self._lock:
            self._pending[want] = self._pending.get(want, 0) + 1
        deadline = started + self.wait_timeout
        try:
            while not ready(snap := self._snapshot):  # read once: another thread may forget() it meanwhile
                if self.provider is not None:
                    made = await asyncio.to_thread(self.provider, want)
                    if made is not None:
                        await self.offer(*made)
                        continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise asyncio.TimeoutError(f"no snapshot of step {min_step} within {self.wait_timeout} s")
                async with self._offered:
                    try:
                        await asyncio.wait_for(self._offered.wait_for(lambda: ready(self._snapshot)),
                                               min(remaining, 0.5))
                    except asyncio.TimeoutError:
                        pass
            return snap
        finally:
            with self._lock:
                self._pending[want] -= 1
                if self._pending[want] <= 0:  # one key per step asked for: forgotten when nobody waits
                    del self._pending[want]

    async def _on_stream(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counted = replied = False
        try:
            req, _ = await asyncio.wait_for(read_frame(reader, pb.StateRequest, 4096), FIRST_FRAME_S)
            if req is None:
                return
            refused = self.admission.reason(info.peer_id.to_base58(), req.token)
            if refused:
                raise WireError(f"not admitted: {refused}")
            # one that names its digest checks what it gets; a peer that holds no state at all has nothing
            if not self.serving and not (req.params_digest and self.holds_state):
                raise WireError("this peer holds no state a round confirmed yet (joining, or just repaired)")
            if req.run_id != self.run_id:
                raise WireError("state request for another run")
            if self._uploads >= self.max_uploads:
                raise WireError("busy: too many downloads from this donor, try another")
            if self.current_step is not None and req.min_step > self.current_step() + FAR_STEPS:
                raise WireError(f"step {req.min_step} is more than {FAR_STEPS} steps past this peer's")
            self._uploads += 1
            counted = True
            # a new download gets the current step, unless another download runs: a new snapshot would
            # make that one's resume start over (two slow followers at one donor)
            step, blob, digest = await self._wait_snapshot(req.min_step,
                                                           fresh=not req.params_digest and self._uploads == 1)
            if not self.serving and digest != req.params_digest:
                raise WireError("this peer holds no state a round confirmed, nor the one asked for")
            if req.params_only:
                blob = await self._without_momenta(step, blob, digest)
            if step == 0 and req.have_step == 0 and req.have_digest == digest and req.offset == 0:
                # a fresh run where both started from the same initialization: momenta are zero on both
                await write_frame(writer, pb.StateChunk(version=PROTOCOL_VERSION, step=0, total_bytes=0, last=True,
                                                        params_digest=digest))
            else:  # a peer that stops reading must not hold a download slot (and this stream) for good
                await asyncio.wait_for(self._send(writer, req, step, blob, digest),
                                       download_bound(len(blob), SERVE_SLACK_S))
            replied = True
        except WireError as e:
            logger.warning("state request from %s refused: %s", info.peer_id, e)
            try:
                await write_frame(writer, pb.StateChunk(version=PROTOCOL_VERSION, error=str(e)[:200]))
                replied = True
            except Exception:
                pass
        except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError, OSError) as e:
            logger.info("state upload to %s ended: %s", info.peer_id, type(e).__name__)
        except Exception as e:  # this peer's own snapshot failed its checks (a bug): say so, serve nothing
            logger.warning("state request from %s failed: %s: %s", info.peer_id, type(e).__name__, e)
            try:
                await write_frame(writer, pb.StateChunk(version=PROTOCOL_VERSION, error="this donor failed to serve"))
                replied = True
            except Exception:
                pass
        finally:
            if counted:  # the download slot is free once everything is written
                self._uploads -= 1
        if replied:  # the newcomer closes once it has read the last chunk: closing first can lose it (QUIC)
            await close_after_reply(reader, writer)

    async def _without_momenta(self, step: int, blob: bytes, digest: bytes) -> bytes:
        """The snapshot without its momenta, made once per snapshot (a resumed download asks again).
        Read once, under the lock: the training thread's ``forget`` may clear it at any moment."""
        with self._lock:
            lean = self._lean
        if lean is None or lean[:2] != (step, digest):
            lean = (step, digest, await asyncio.to_thread(snapshot.without_momenta, blob))
            with self._lock:
                self._lean = lean
        return lean[2]

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, req: pb.StateRequest, step: int, blob: bytes, digest: bytes) -> None:
        start = req.offset
        if req.params_digest and req.params_digest != digest:
            start = 0  # this donor moved on from the snapshot being resumed: send its own from the start
        if start > len(blob):
            raise WireError(f"offset {start} past the snapshot's {len(blob)} bytes")
        for offset in range(start, max(len(blob), start + 1), CHUNK_BYTES):
            await write_frame(writer, pb.StateChunk(
                version=PROTOCOL_VERSION, step=step, total_bytes=len(blob), offset=offset,
                data=blob[offset : offset + CHUNK_BYTES], last=offset + CHUNK_BYTES >= len(blob),
                params_digest=digest))
            if offset > start:  # the newcomer holds part of the snapshot now
                failpoints.reached("serve")


class _Download:
    """What has arrived so far; the first chunk fixes the snapshot (step, digest, size) to resume."""

    def __init__(self) -> None:
        self.blob = bytearray()
        self.step: int | None = None
        self.digest = b""
        self.total: int | None = None
        self.donors: set[str] = set()  # those that sent part of it

    @property
    def done(self) -> bool:
        return self.total is not None and len(self.blob) == self.total


async def download_state(p2p: P2P, donors: list[str], run_id: str, *, min_step: int, max_bytes: int,
                         timeout: float = 120.0, attempts: int = 6, have: tuple[int, bytes] | None = None,
                         token: bytes = b"", params_only: bool = False,
                         check: Callable[[int, bytes, bytes], None] | None = None,
                         served: set[str] | None = None, wanted: bytes = b"") -> tuple[int, bytes, bytes]:
    """(step, snapshot bytes, parameter digest) from donors, resuming across them; ``params_only``:
    without the momenta (``snapshot.without_momenta``; a donor of an older version sends them anyway).

    Donors are tried in the given order first (put the fastest first), in random order on retries.

    ``have`` = (step, parameter digest) of the requester's own state; a donor at step 0 with the
    same parameters answers with an empty snapshot (b""): keep your state. ``check(step, blob,
    digest)`` runs on each completed snapshot (not on the empty answer) and raises if it is bad: its
    donors (those that served part of it) are not asked again, and the download starts over.
    ``served`` receives the donors of the snapshot returned (a resumed one has several); ``wanted``: the
    parameter digest the requester will accept (the run's end), named in the request so that a donor
    whose state no round confirmed yet still serves it when it holds exactly that."""
    if not donors:
        raise StateTransferError("no donor to download state from")
    progress, errors, left = _Download(), [], set()
    deadline = time.monotonic() + timeout
    for attempt in range(attempts):
        for donor in donors if attempt == 0 else random.sample(donors, len(donors)):
            if donor in left:
                continue
            for _ in range(1 + SAME_DONOR_RETRIES):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                before = len(progress.blob)
                try:
                    await asyncio.wait_for(_fetch_from(p2p, donor, run_id, min_step, max_bytes, progress, have,
                                                       token, params_only, wanted), remaining)
                except Exception as e:
                    errors.append(f"{donor[:16]}: {type(e).__name__}: {e}")
                    logger.info("state download from %s stopped at %d bytes: %s", donor, len(progress.blob), e)
                    if isinstance(e, SlowDonor):
                        left.add(donor)
                    # its stream broke mid-transfer: ask it again first, it still holds this snapshot where
                    # the next donor may have moved on (seen: a 1 Mbit/s download cut at 1 MB started over)
                    elif len(progress.blob) > before:
                        continue
                break
            if len(progress.blob) > 0:
                progress.donors.add(donor)
            if progress.done:
                blob = bytes(progress.blob)
                try:
                    if check is not None and blob:
                        check(progress.step, blob, progress.digest)
                except Exception as e:  # a self-consistent lie (or a model of another shape): its donors go
                    errors.append(f"{donor[:16]}: its snapshot: {type(e).__name__}: {e}")
                    logger.warning("state download: the snapshot from %s is refused: %s", ", ".join(
                        d[:16] for d in sorted(progress.donors)), e)
                    left |= progress.donors
                    progress = _Download()
                    continue
                if served is not None:
                    served.update(progress.donors)
                return progress.step, blob, progress.digest
        # every donor was busy, joining or gone: back off (with jitter, so newcomers spread) and retry
        await asyncio.sleep(min(0.5 * 2 ** attempt, 5.0) * (0.5 + random.random()))
    raise StateTransferError("state download failed: " + "; ".join(errors[-4:]))


async def _fetch_from(p2p: P2P, donor: str, run_id: str, min_step: int, max_bytes: int, progress: _Download,
                      have: tuple[int, bytes] | None, token: bytes, params_only: bool, wanted: bytes = b"") -> None:
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(donor), STATE_PROTOCOL)
    try:
        have_step, have_digest = have if have is not None and not progress.blob else (0, b"")
        await write_frame(writer, pb.StateRequest(version=PROTOCOL_VERSION, run_id=run_id.encode(), min_step=min_step,
                                                  offset=len(progress.blob), params_digest=progress.digest or wanted,
                                                  have_step=have_step, have_digest=have_digest, token=token,
                                                  params_only=params_only))
        wait, first_at, received = FIRST_CHUNK_S, None, 0
        while not progress.done:
            try:
                chunk, _ = await asyncio.wait_for(read_frame(reader, pb.StateChunk), wait)
            except asyncio.TimeoutError:
                raise StateTransferError(f"donor sent nothing for {wait:.0f} s") from None
            if chunk is None:
                raise StateTransferError("donor closed the stream")
            if chunk.error:
                raise StateTransferError(f"donor refused: {chunk.error}")
            if chunk.total_bytes > max_bytes or chunk.step < min_step:
                raise StateTransferError(f"snapshot of {chunk.total_bytes} bytes at step {chunk.step} does not fit")
            if len(chunk.params_digest) != DIGEST_BYTES:  # sent back in the next request: donors cap its size
                raise StateTransferError(f"a parameter digest of {len(chunk.params_digest)} bytes")
            if chunk.total_bytes == 0 and not (have is not None and have[0] == chunk.step == 0
                                               and chunk.params_digest == have[1]):
                raise StateTransferError("an empty snapshot, but this peer does not hold that state (it is "
                                         "the answer to a peer at step 0 with the same parameters only)")
            snapshot_id = (chunk.step, chunk.params_digest, chunk.total_bytes)
            if progress.step is None or (snapshot_id != (progress.step, progress.digest, progress.total)
                                         and chunk.offset == 0):
                if progress.blob:
                    logger.info("donor %s sends a newer snapshot (step %d): starting over", donor[:16], chunk.step)
                progress.blob.clear()
                progress.donors.clear()
                progress.step, progress.digest, progress.total = snapshot_id
            if snapshot_id != (progress.step, progress.digest, progress.total):
                raise StateTransferError("donor's snapshot differs from the one being resumed")
            if chunk.offset != len(progress.blob) or len(progress.blob) + len(chunk.data) > progress.total:
                raise StateTransferError(f"chunk at {chunk.offset} after {len(progress.blob)} bytes")
            progress.blob += chunk.data
            wait = STALL_S
            received += len(chunk.data)
            first_at = first_at or time.monotonic()
            elapsed = time.monotonic() - first_at
            if elapsed > SLOW_DONOR_S and received < elapsed * MIN_RATE / 4:  # a chunk every 29 s kept it "alive"
                raise SlowDonor(f"{received} bytes in {elapsed:.0f} s")
            failpoints.reached("download")
    finally:
        writer.close()
