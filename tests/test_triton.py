"""The Triton backend against the reference: on CUDA directly, on CPU through the Triton interpreter.

The interpreter must be switched on before triton is first imported (triton's own reductions are decorated
at import time), and importing moba_hf.kernels already imports triton through torch._dynamo. So on a CPU
machine `test_kernels_under_interpreter` reruns this file in a subprocess with TRITON_INTERPRET=1, and the
kernel tests skip in the parent. The interpreter runs each program in NumPy, so shapes stay small; they still
cover partial tiles (block segments not a multiple of the 64-pair tile, Nk not a multiple of the block),
head_dim padding, GQA and the gate options. Interpreter limit: its bfloat16 tl.dot is wrong (a 16x16 bf16 dot
is off by ~1e10), so bf16 is checked on a GPU (benchmarks/gpu_check.py); float16 stands in for the low-precision
rule here.
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys

import pytest
import torch
from kernel_cases import (
    assert_propagates_like_reference,
    call,
    case_tol,
    flash_atol,
    moba_inputs,
    rounding_tol,
    selection,
)
from kernel_cases import fwd_bwd as _fwd_bwd
from kernel_cases import gate_id as _gate_id
from kernel_cases import shape_id as _id

from moba_hf.kernels import moba_attention_reference

pytestmark = pytest.mark.triton

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETING or not torch.cuda.is_available() else "cuda"
RUNS_KERNELS = INTERPRETING or DEVICE == "cuda"

# (B, Hq, Hkv, Nq, Nk, D, block_size, top_k)
SHAPES = [
    (2, 4, 2, 37, 37, 16, 16, 3),  # odd length, GQA, batch 2, partial last block
    (1, 4, 2, 63, 63, 60, 16, 3),  # D=60: head_dim padded to 64 inside the kernel
    (1, 4, 1, 40, 111, 16, 20, 2),  # Nq < Nk (chunked prefill), MQA, block_size not dividing N
    (2, 2, 2, 1, 50, 8, 16, 3),  # decode: Nq = 1
    (2, 4, 2, 30, 77, 12, 10, 1),  # top_k = 1: own block only
    (1, 2, 1, 50, 50, 8, 7, 100),  # top_k >= blocks: plain causal
    (1, 2, 1, 33, 33, 8, 64, 3),  # block_size >= Nk
    (1, 2, 1, 150, 150, 8, 8, 4),  # segments of several 64-pair tiles, many blocks, blocks shorter than a key tile
]
GATES = [
    {"sink_blocks": 1, "local_blocks": 1},
    {"pooling": "max", "sink_blocks": 2},
    {"pooling": "mean+max", "local_blocks": 1},
    {"pooling": "bound", "local_blocks": 1},
    {"local_blocks": 1, "top_p": 0.5, "min_top_k": 2},  # an adaptive budget
]


@pytest.fixture(scope="module")
def triton_impl():
    if not RUNS_KERNELS:
        pytest.skip("kernel tests run in the TRITON_INTERPRET=1 subprocess (test_kernels_under_interpreter)")
    import moba_hf.kernels.triton_impl as module

    return module


def test_kernels_under_interpreter():
    """CPU machine: rerun this file with the interpreter on, in a fresh process (see the module docstring)."""
    if RUNS_KERNELS:
        pytest.skip("kernels run in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


def _inputs(shape, dtype, requires_grad=True):
    return moba_inputs(shape, dtype, DEVICE, requires_grad)


def _assert_matches_reference(fn, q, k, v, tol, **kw):
    grad = torch.randn(q.shape, dtype=q.dtype, device=q.device)
    expected = _fwd_bwd(moba_attention_reference, q, k, v, grad, **kw)
    actual = _fwd_bwd(fn, q, k, v, grad, **kw)
    for name, e, a in zip(("out", "dq", "dk", "dv"), expected, actual, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        torch.testing.assert_close(a, e, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_matches_reference(triton_impl, shape, dtype):
    q, k, v = _inputs(shape, dtype)
    _assert_matches_reference(
        triton_impl.moba_attention_triton, q, k, v, case_tol(shape, dtype), block_size=shape[6], top_k=shape[7]
    )


@pytest.mark.parametrize("gate", GATES, ids=_gate_id)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[7]], ids=_id)
def test_gate_options_match_reference(triton_impl, shape, gate):
    q, k, v = _inputs(shape, torch.float64)
    _assert_matches_reference(
        triton_impl.moba_attention_triton,
        q,
        k,
        v,
        case_tol(shape, torch.float64),
        block_size=shape[6],
        top_k=shape[7],
        **gate,
    )


def test_float64_elementwise_matmul_path(triton_impl, monkeypatch):
    """The float64 path GPUs take (no tl.dot, 16-row tiles), here on the interpreter."""
    monkeypatch.setattr(triton_impl, "_FMA_DEVICES", ("cuda", "cpu"))
    for shape in (SHAPES[0], SHAPES[2]):
        q, k, v = _inputs(shape, torch.float64)
        _assert_matches_reference(
            triton_impl.moba_attention_triton,
            q,
            k,
            v,
            case_tol(shape, torch.float64),
            block_size=shape[6],
            top_k=shape[7],
            sink_blocks=1,
        )


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_nan_inf_propagate_like_reference(triton_impl, which, value):
    """A row that sees a NaN / inf is non-finite as in the reference, the others are untouched."""
    assert_propagates_like_reference(triton_impl.moba_attention_triton, SHAPES[0], which, value, device=DEVICE)


def test_non_contiguous_inputs_and_scale(triton_impl):
    """Transformers hands over q/k/v as transposed views of [B, N, H, D]; a custom scale must reach both passes."""
    q, k, v = (
        torch.randn(2, 70, h, 8, dtype=torch.float64, device=DEVICE).transpose(1, 2).requires_grad_() for h in (4, 2, 2)
    )
    tol = rounding_tol(torch.float64, 70, 70, 8)
    _assert_matches_reference(triton_impl.moba_attention_triton, q, k, v, tol, block_size=16, top_k=3, scale=0.3)


def test_float16_within_twice_torch_error(triton_impl):
    """flash-attention's rule: error vs an fp32 reference at most 2x that of the same math done naively in fp16."""
    shape = (1, 4, 2, 100, 100, 32, 16, 3)
    kw = {"block_size": 16, "top_k": 3}
    q, k, v = _inputs(shape, torch.float32)
    grad = torch.randn(q.shape, device=DEVICE)
    exact = _fwd_bwd(moba_attention_reference, q, k, v, grad, **kw)
    half = [t.detach().half().requires_grad_() for t in (q, k, v)]

    def naive_fp16(q, k, v, plan, scale=None):
        nq, nk = q.shape[2], k.shape[2]
        sel = selection(q, k, block_size=plan.block_size, top_k=plan.top_k)
        key_pos = torch.arange(nk, device=q.device)
        q_pos = torch.arange(nk - nq, nk, device=q.device)
        allowed = sel[..., key_pos // plan.block_size] & (key_pos[None, :] <= q_pos[:, None])
        g = q.shape[1] // k.shape[1]
        scores = q @ k.repeat_interleave(g, dim=1).transpose(-1, -2) * q.shape[-1] ** -0.5
        return scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ v.repeat_interleave(g, dim=1)

    baseline = _fwd_bwd(naive_fp16, *half, grad.half(), **kw)
    fast = _fwd_bwd(triton_impl.moba_attention_triton, *half, grad.half(), **kw)
    for name, e, b, f in zip(("out", "dq", "dk", "dv"), exact, baseline, fast, strict=True):
        assert f.dtype == torch.float16, name
        err, base = (f.float() - e).abs().max(), (b.float() - e).abs().max()
        assert err <= 2 * base + flash_atol(e), f"{name}: triton error {err:.3g} > 2 x fp16 torch error {base:.3g}"


def test_signature_equals_reference():
    from moba_hf.kernels.triton_impl import moba_attention_triton

    assert inspect.signature(moba_attention_triton) == inspect.signature(moba_attention_reference)


def test_supports_only_cuda_or_interpreter(monkeypatch):
    from moba_hf.kernels import _REGISTRY
    from moba_hf.kernels.triton_impl import moba_attention_triton

    q = torch.zeros(1, 1, 1, 8)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _REGISTRY["triton"].runs_on(q) and not _REGISTRY["triton"].auto_may_pick(q)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not _REGISTRY["triton"].runs_on(q)
    with pytest.raises(ValueError, match="CUDA"):
        call(moba_attention_triton, q, q, q, block_size=4, top_k=2)


def test_bad_arguments_raise_value_error():
    from moba_hf.kernels.triton_impl import moba_attention_triton

    q, kv = torch.zeros(1, 2, 8, 8), torch.zeros(1, 3, 8, 8)
    with pytest.raises(ValueError, match="top_k"):
        call(moba_attention_triton, q, q, q, block_size=4, top_k=0)
    with pytest.raises(ValueError, match="multiple"):
        call(moba_attention_triton, q, kv, kv, block_size=4, top_k=2)


@pytest.mark.parametrize(
    ("dtype", "fma"), [("bf16", False), ("fp64", True)], ids=["bf16-tensor-cores", "fp64-elementwise"]
)
def test_kernels_compile_for_sm90(dtype, fma, tmp_path, monkeypatch):
    """Lower the kernel at every stage to an H100 / H200 cubin, no GPU needed: the interpreter never runs Triton's
    compiler."""
    if INTERPRETING:
        pytest.skip("kernels are interpreted in this process")
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moba_hf.kernels import triton_impl

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compile for real, leave no cache behind
    acc = "fp64" if fma else "fp32"
    consts = {"HEAD_DIM": 64, "D_PAD": 64, "BLOCK_M": 16 if fma else 64, "BLOCK_N": 16 if fma else 64}
    consts |= {"ACC": tl.float64 if fma else tl.float32, "FMA": fma}
    types = {n: f"*{dtype}" for n in ("Q", "K", "V", "DO")} | {"scale": "fp32"}
    types |= {n: "*i32" for n in ("ROWS", "TILE_SEG", "TILE_START", "TILE_END")}
    types |= {n: f"*{acc}" for n in ("LSE", "OUT", "DELTA", "DK", "DV")}
    kernel = triton_impl._moba_kernel
    stages = (triton_impl._PAIR_LSE, triton_impl._FORWARD, triton_impl._BACKWARD)
    for stage in stages if not fma else stages[1:2]:  # float64: one stage is enough to cover the FMA path
        constexprs = consts | {"STAGE": stage.value}
        names = inspect.signature(kernel.fn).parameters
        signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=constexprs), GPUTarget("cuda", 90, 32)
        )
        assert compiled.asm["cubin"], f"stage {stage.value}"


def test_import_without_triton_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # None in sys.modules makes `import triton` fail
    monkeypatch.setitem(sys.modules, "triton.language", None)
    monkeypatch.delitem(sys.modules, "moba_hf.kernels.triton_impl", raising=False)
    with pytest.raises(ImportError, match="needs the triton package"):
        importlib.import_module("moba_hf.kernels.triton_impl")


def test_registry_runs_triton_when_interpreting(triton_impl, monkeypatch):
    """With the interpreter on, moba_attention(backend="triton") dispatches to this module instead of falling back."""
    from moba_hf import kernels

    monkeypatch.setitem(kernels._loaded, "triton", triton_impl.moba_attention_triton)
    q = torch.randn(1, 2, 20, 8, dtype=torch.float64, device=DEVICE)
    assert kernels.resolve_backend("triton", q) == "triton"
    out = kernels.moba_attention(q, q, q, block_size=8, top_k=2, backend="triton")
    tol = rounding_tol(torch.float64, 20, 20, 8)
    torch.testing.assert_close(out, call(moba_attention_reference, q, q, q, block_size=8, top_k=2), atol=tol, rtol=tol)
