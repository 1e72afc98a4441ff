import os

# Triton kernels run on CPU tensors through the interpreter; it must be chosen before triton is imported.
# A CUDA machine runs them compiled instead.
if os.environ.get("LIONCUB_TRITON_COMPILED") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
