"""Die on purpose at one named point of the protocol: fault tests of whole processes.

Killing a peer from outside at "the moment it is mid-answer" is a race; killing it from inside at
that exact point is not. Set ``LIONCUB_FAILPOINT=<point>[@<step>]`` in a peer's environment and the
process SIGKILLs itself (no cleanup, no goodbye: what a crash or a pulled plug looks like to the
others) the first time it reaches the point, on or after that step:

- ``upload``    a vote round, after its first vote chunk went out;
- ``reduce``    a vote round, when this peer's part is reduced but nobody has its result yet;
- ``result``    a vote round, after the first result chunk went out (some voters have it, others not);
                in a two-level vote, the first chunk of the part's result to its own group, after combining;
- ``combine``   a two-level vote round, after the first chunk of a slice this peer combined for the
                groups' reducers of its part went out (some groups have the slice, others not);
- ``momentum``  a whole-buffer momentum-averaging round, after its first chunk went out;
- ``serve``     serving state to a newcomer, after the second chunk went out;
- ``download``  downloading state as a newcomer, after the first chunk arrived.

A fault test whose donor is armed with ``serve`` needs the newcomer to ask that donor: donors are
tried in the order the newcomer measured them, random at first, so ``LIONCUB_DONOR=<peer id>`` makes
it ask that one first (``StateSync.donors``).

A stall of the training thread alone (a hung data loader: the event loop goes on announcing the
peer) comes from ``LIONCUB_HANG=<step>:<seconds>``: the trainer sleeps that long once, before that step.

Unset (the normal case), every check is one comparison with ``None``.
"""
from __future__ import annotations

import os
import signal
import time

POINTS = ("upload", "reduce", "result", "combine", "momentum", "serve", "download")
ENV = "LIONCUB_FAILPOINT"
HANG_ENV = "LIONCUB_HANG"
DONOR_ENV = "LIONCUB_DONOR"
DONOR = os.environ.get(DONOR_ENV) or None  # a fault test's armed donor, asked first (unset: nothing changes)


def parse(value: str | None) -> tuple[str, int] | None:
    """``"result@20"`` -> ("result", 20); ``"serve"`` -> ("serve", 0); unset or empty -> None."""
    if not value:
        return None
    point, _, step = value.partition("@")
    if point not in POINTS:
        raise ValueError(f"{ENV}={value!r}: unknown point {point!r}; expected one of {', '.join(POINTS)}")
    try:
        return point, int(step) if step else 0
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: the step after '@' must be an integer") from None


ARMED = parse(os.environ.get(ENV))


def reached(point: str, step: int = 0) -> None:
    """Kill this process if it is armed for ``point`` and ``step`` is at or past the armed step."""
    if ARMED is not None and ARMED[0] == point and step >= ARMED[1]:
        os.kill(os.getpid(), signal.SIGKILL)


def parse_hang(value: str | None) -> tuple[int, float] | None:
    """``"20:12"`` -> (20, 12.0): sleep 12 s before step 20; unset or empty -> None."""
    if not value:
        return None
    step, _, seconds = value.partition(":")
    try:
        parsed = int(step), float(seconds)
    except ValueError:
        raise ValueError(f"{HANG_ENV}={value!r}: expected STEP:SECONDS, like 20:12") from None
    if parsed[0] < 0 or not 0 <= parsed[1] <= 3600:
        raise ValueError(f"{HANG_ENV}={value!r}: the step must be >= 0 and the seconds in [0, 3600]")
    return parsed


HANG = parse_hang(os.environ.get(HANG_ENV))
_hung = False


def before_step(step: int) -> None:
    """Sleep the calling (training) thread once, at the first step at or past the armed one."""
    global _hung
    if HANG is not None and not _hung and step >= HANG[0]:
        _hung = True
        time.sleep(HANG[1])
