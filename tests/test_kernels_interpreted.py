"""The CPU suite runs the Triton kernel tests (tests/test_kernels.py) in Triton's interpreter: a subprocess with
TRITON_INTERPRET=1 (it must be set before Triton is imported) and no GPU, in float32."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_pass_in_the_interpreter():
    """Two interpreter processes side by side, 50-60 s each (the Triton MoE and routing-layout tests and the
    dense model's static path; the rest): the interpreter is single-threaded numpy. Each runs its tests in one
    process (``-o addopts=``: without pyproject's ``-n 2``, as the suite's own workers are already two)."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    halves = [subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-q",
                                "-m", "kernels and not gpu", "-k", k, "tests/test_kernels.py"], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for k in ("triton_moe or routing_layout or (static_padded and dense)",
                        "not (triton_moe or routing_layout or (static_padded and dense))")]
    total = 0
    for proc in halves:
        out = proc.communicate(timeout=900)[0]
        assert proc.returncode == 0, out[-4000:]
        passed = re.search(r"(\d+) passed", out)
        assert passed and "skipped" not in out, out[-4000:]
        total += int(passed.group(1))
    assert total >= 16  # every kernel test ran


FUSED_KERNELS = {
    # kernel: (pointer types in order, constexpr variants): what the entry points in models/fused.py launch
    "_rms_norm_kernel": ("bf16 bf16 bf16 bf16 bf16 fp32 fp32", [dict(HAS_RES=r, SCALED=sc, BLOCK=1024, PDL=p)
                                                                for r in (0, 1) for sc in (0, 1) for p in (0, 1)]),
    "_rotary_write_kv_kernel": ("bf16 i64 fp32 fp32 bf16 i64 bf16 bf16",
                                [dict(NUM_HEADS=h, NUM_KV_HEADS=kv, HEADS_PAD=pad, KV_HEADS_PAD=kv, HEAD_DIM=d,
                                      QK_NORM=qk, KV_FP8=0, PDL=p)
                                 for h, kv, pad, d in ((16, 8, 16, 64), (14, 2, 16, 64), (32, 4, 32, 128))
                                 for qk in (0, 1) for p in (0, 1)]),
    "_silu_mul_kernel": ("bf16 bf16", [dict(BLOCK=1024, GELU=g, PDL=p) for p in (0, 1) for g in (0, 1)]),
    "_moe_combine_kernel": ("bf16 i32 fp32 bf16", [dict(TOP_K=8, BLOCK=1024, PDL=0)]),
    "_moe_combine_add_norm_kernel": ("bf16 i32 fp32 bf16 bf16 bf16 bf16", [dict(TOP_K=8, BLOCK=1024, PDL=1)]),
    "_moe_route_kernel": ("bf16 i32 fp32 i32 i32", [dict(TOP_K=8, E_PAD=32, NORM_TOPK=n, PDL=0) for n in (0, 1)]),
    "_moe_scatter_kernel": ("bf16 i32 i32 i32 bf16 i32 i32", [dict(TOP_K=8, E_PAD=32, H_PAD=1024, PDL=1)]),
    "_argmax_prob_kernel": ("bf16 i64 fp32", [dict(BLOCK=4096, WITH_PROB=w) for w in (0, 1)]),
    "_sample_kernel": ("bf16 fp32 i64 fp32 i64 i64 i64 u8 fp32 i32 u8 i64 i32",
                       [dict(BLOCK=4096, HAS_MIN_P=m, HAS_SLOTS=s, PENALTIES=0, HAS_BITMASK=0) for m in (0, 1)
                        for s in (0, 1)]
                       + [dict(BLOCK=4096, HAS_MIN_P=1, HAS_SLOTS=1, PENALTIES=1, HAS_BITMASK=b) for b in (0, 1)]),
    "_count_kernel": ("i64 i64 i64 u8 i32", [dict(Q_PAD=q) for q in (1, 4)]),
    "_penalize_kernel": ("fp32 i64 i32 u8 fp32 fp32 fp32 i64", [dict(BLOCK=4096, NUM_DRAFTS=k) for k in (0, 3)]),
    "_decode_inputs_kernel": ("i64 i64 u8 i64 i32 i64", [dict(Q_PAD=q) for q in (1, 4, 8)]),
    "_advance_inputs_kernel": ("i64 i64 i32", [dict(BLOCK=256)]),
    "_accept_kernel": ("i64 i64 i64 i64 i64 i64 i64 i64 i32", [dict(Q_PAD=q, W_PAD=8, GIVEN=g) for q in (1, 4, 8)
                                                              for g in (0, 1)]),
    # (models/triton_attention.py's: float32 queries take tl.dot's IEEE precision, 16-bit ones its default)
    "triton_attention._paged_attention_kernel": (
        "fp32 fp32 fp32 fp32 fp32 i32 i32 i32 i32",
        [dict(GROUP=3, HEAD_DIM=64, BLOCK_SIZE=16, BLOCK_Q=q, BLOCK_M=16, BLOCK_N=64, SPLIT=sp, ONE_QBLOCK=q == 4,
              WINDOW=0, SOFTCAP=0, DOT_PRECISION=dp, PDL=1)
         for q in (4, 5) for sp in (0, 1) for dp in ("ieee", "tf32")]),
    # (models/fp8.py's, named with their module)
    "fp8._rms_norm_quant_kernel": ("bf16 bf16 bf16 fp8e4nv bf16 fp32 fp32 fp32",
                                   [dict(HAS_RES=r, SCALED=sc, BLOCK=2048, PDL=1) for r in (0, 1) for sc in (0, 1)]),
    "fp8._act_mul_quant_kernel": ("bf16 fp8e4nv fp32", [dict(BLOCK=b, GELU=g, PDL=1) for b in (1024, 2048)
                                                         for g in (0, 1)]),
}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("name", sorted(FUSED_KERNELS))
def test_fused_kernels_build_for_hopper_on_the_cpu(name):
    """The interpreter runs kernels as Python, so it accepts what the compiler rejects (a variable whose shape
    changes across an ``if``, a type mismatch in a loop). Each fused kernel's Triton IR is built here for sm90,
    without a GPU, in the launch's variants: a kernel that does not compile fails on the CPU, not at the
    first GPU capture."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget

    nvidia = pytest.importorskip("triton.backends.nvidia.compiler")
    module, _, kernel = name.rpartition(".")
    fn = getattr(importlib.import_module(f"models.{module or 'fused'}"), kernel)
    pointers, variants = FUSED_KERNELS[name]
    kinds = iter(pointers.split())
    signature = {}
    for param in fn.params:
        if param.is_constexpr:
            continue
        arg = param.name
        signature[arg] = ("*" + next(kinds) if arg.endswith("_ptr") else "i64" if arg.startswith("stride")
                          else "fp32" if arg in ("eps", "k_inv", "v_inv", "qk_scale", "v_scale", "softcap") else "i32")
    target = GPUTarget("cuda", 90, 32)
    backend = nvidia.CUDABackend(target)
    options = backend.parse_options({})
    for constexprs in variants:
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        src = triton.compiler.ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                                        constexprs=constexprs)
        src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
