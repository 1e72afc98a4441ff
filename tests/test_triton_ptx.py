"""The one-launch Triton kernels read and write 16 bytes at a time: checked in their PTX, no GPU needed.

Their speed on a GPU (`docs/benchmarks.md`, "On an H200": lion pack 3.5x -> 1.2x a copy) comes from
two things the compiler cannot see by itself: that the tensor addresses in the table are 16-byte
aligned (a hint on the pointer) and that a chunk wholly inside its tensor needs no mask. Lose either
and every access is split into 4-byte ones; this compiles the kernels for an H100/H200 (sm_90) in a
subprocess without ``TRITON_INTERPRET`` and counts the vector loads and stores."""
import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, re
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lioncub_p2p.ops import triton_impl as impl

TYPES = dict(u_ptr="*u8", coef_ptr="*fp32", scalar_ptr="*fp32", out_ptr="*u8")

def vectors(name, **constexprs):
    fn = getattr(impl, name)
    signature = {a: "constexpr" if a in constexprs else TYPES.get(a, "*i64") for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a not in constexprs}
    kernel = triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return len(re.findall(r"\b(?:ld|st)\.global\.v4\.b32", kernel.asm["ptx"]))

out = {}
for aligned in (True, False):
    out[f"pack {aligned}"] = vectors("_lion_pack_many_kernel", ELEM=tl.float32, IS_BF16=False, ALIGNED=aligned,
                                     BLOCK=impl.PACK_BLOCK)
    out[f"apply {aligned}"] = vectors("_apply_many_kernel", ELEM=tl.float32, IS_BF16=False, PACKED=True,
                                      ALIGNED=aligned, BLOCK=impl.ELEM_BLOCK)
# single-tensor kernels: pointers 16-byte aligned (Triton specializes them), a length of no known alignment
F32 = dict(numel="i64", nbytes="i64", key="i64", beta1="fp32", one_minus_beta1="fp32", beta2="fp32",
           one_minus_beta2="fp32", lr="fp32", decay_scale="fp32", g_ptr="*fp32", m_ptr="*fp32", p_ptr="*fp32",
           out_ptr="*u8", u_ptr="*u8")

def single(name, **constexprs):
    fn = getattr(impl, name)
    signature = {a: "constexpr" if a in constexprs else F32[a] for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if F32.get(a, "").startswith("*")}
    kernel = triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return len(re.findall(r"\b(?:ld|st)\.global\.v4\.b32", kernel.asm["ptx"]))

out["lion pack one"] = single("_lion_pack_kernel", G_BF16=False, M_BF16=False, FLIP=False, BLOCK=impl.PACK_BLOCK)
out["apply one"] = single("_apply_kernel", PACKED=True, HAS_DECAY=True, P_BF16=False, BLOCK=impl.ELEM_BLOCK)
print(json.dumps(out))
"""


def test_the_one_launch_kernels_use_16_byte_accesses_when_addresses_are_aligned():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the kernels' fma is explicit; this only silences a warning
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["pack True"] > 0 and counts["apply True"] > 0, counts  # whole chunks, hinted pointers
    assert counts["pack False"] == counts["apply False"] == 0, counts  # no hint: 4-byte accesses (correct)
    # one tensor whose length is not a multiple of 16: its whole programs run without masks
    assert counts["lion pack one"] > 0 and counts["apply one"] > 0, counts
