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

Unset (the normal case), every check is one comparison with ``None``.
"""
from __future__ import annotations

import os
import signal

POINTS = ("upload", "reduce", "result", "combine", "momentum", "serve", "download")
ENV = "LIONCUB_FAILPOINT"


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
