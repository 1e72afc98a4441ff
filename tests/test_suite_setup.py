"""The suite's own set-up holds: trainer-process tests share one xdist worker (``conftest.py``)."""
from __future__ import annotations

import pytest


@pytest.mark.xdist_group("processes")
def test_the_processes_group_reaches_xdists_scheduler(request):
    """``--dist loadgroup`` learns a test's group from a suffix xdist appends to its node id; with pytest
    9.2 the suffix no longer took (pytest-dev/pytest-xdist#1386) and every trainer-process test was
    scheduled on its own, two at a time on 2 cores, with nothing failing to say so."""
    if hasattr(request.config, "workerinput"):  # an xdist worker: the suite's addopts ask for loadgroup
        assert request.config.option.loadgroup and request.node.nodeid.endswith("@processes"), request.node.nodeid
    else:  # one process (-n 0): nothing is scheduled, so nothing to group
        assert request.config.getoption("numprocesses", None) in (None, 0), "workers without a worker's config"
