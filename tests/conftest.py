import os

# Triton kernels run on CPU tensors through the interpreter; it must be chosen before triton is imported.
# A CUDA machine runs them compiled instead.
if os.environ.get("LIONCUB_TRITON_COMPILED") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

# The tests' tensors are small: with torch's default thread pool, every op waits for a second thread
# that a busy 2-core machine schedules late (a 64-wide MLP's backward took 25 ms instead of 0.1 ms at
# load 10). One thread, as the peer processes the tests start have (OMP_NUM_THREADS=1), unless the
# caller chose otherwise.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

# The suite runs on two pytest-xdist workers (pyproject: -n 2 --dist loadgroup). Three were not worth
# it: 845 s against 906 s with two (2026-12-06), and under their load a test failed that never does with
# two (a healthy peer followed for 4 steps); before, 663-747 s against 853 s, with two other tests flaky
# (since fixed); 2026-12-07: 737 s against 869 s, all passed (one run; the trainer-process test
# test_trainers_kill_join_client_mode took 105 s instead of 68, the load it once failed under). Tests that run
# whole trainer processes (test_sim, test_multihost, test_swarm_processes, the NAT trainer) share the xdist group
# "processes": one worker runs them one after another, so two of them never load the 2 cores at once
# (it starts first: xdist hands out the largest group first; pytest 9.2 broke the grouping, hence the
# pin in pyproject.toml and tests/test_suite_setup.py); every other test goes to whichever worker is free. Items are handed out in collection order, so the
# longest files go first (seconds measured on a 2-core machine); unlisted files keep their order.
LONGEST_FILES_FIRST = {
    "test_sim.py": 380, "test_swarm.py": 120, "test_attacks_round.py": 100, "test_cli.py": 100,
    "test_swarm_processes.py": 95, "test_attacks_membership.py": 90, "test_allreduce.py": 60,
    "test_multihost.py": 60, "test_cluster.py": 45, "test_examples.py": 30,
}


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: -LONGEST_FILES_FIRST.get(item.path.name, 0))  # stable: order within a file kept
