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
