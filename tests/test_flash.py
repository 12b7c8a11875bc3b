"""The "flash" backend (flash-attn varlen) against the reference, forward and q/k/v gradients.

flash-attn needs a CUDA GPU and rarely installs on a CPU machine, so the CPU tests run the backend on
tests/fake_flash_attn: a pure-PyTorch `flash_attn_varlen_func` with the real one's signature and semantics
(bottom-right causal mask, GQA by head count, softmax_lse [heads, total_q], gradients from `out` only) that also
takes float64, so the comparison is exact up to float64 rounding. `test_fake_follows_flash_attn_contract` pins the
stand-in to the documented contract; the cuda tests compare it with, and run the backend on, the real library
when importable.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

import kernel_cases
import pytest
import torch
from kernel_cases import assert_propagates_like_reference, call, flash_atol, rounding_tol
from kernel_cases import fwd_bwd as _fwd_bwd
from kernel_cases import gate_id as _gate_id
from kernel_cases import moba_inputs as _inputs
from kernel_cases import shape_id as _id

from moba_hf import kernels
from moba_hf.kernels import moba_attention, moba_attention_reference, resolve_backend
from moba_hf.kernels.selection import selected_blocks
from moba_hf.kernels.torch_impl import moba_attention_torch

FAKE = Path(__file__).parent / "fake_flash_attn"
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
_MODULES = ("flash_attn", "moba_hf.kernels.flash")

# the shared cases and decode with GQA: flash-attn's one-query-per-sequence path
SHAPES = [*kernel_cases.SHAPES, (2, 4, 1, 1, 50, 8, 16, 3)]
GATES = [
    {"pooling": "max", "sink_blocks": 1},
    {"pooling": "mean+max", "local_blocks": 1},
    {"pooling": "bound", "sink_blocks": 1},
    {"top_k": 1, "sink_blocks": 1, "local_blocks": 1},  # forced blocks only
    {"pooling": "mean+max", "top_p": 0.5},  # an adaptive budget
]


def _assert_matches_reference(fn, q, k, v, **kw):
    tol = rounding_tol(q.dtype, q.shape[2], k.shape[2], q.shape[3])
    grad = torch.randn(q.shape, dtype=q.dtype)
    expected = _fwd_bwd(moba_attention_reference, q, k, v, grad, **kw)
    actual = _fwd_bwd(fn, q, k, v, grad, **kw)
    for name, e, a in zip(("out", "dq", "dk", "dv"), expected, actual, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        torch.testing.assert_close(a, e, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture
def isolated(monkeypatch):
    """A fresh backend registry and fresh imports of flash_attn / the flash backend, all undone afterwards."""
    # earlier tests may have tried (and failed) to load "flash": forget that here
    monkeypatch.setattr(kernels, "_loaded", {n: f for n, f in kernels._loaded.items() if n != "flash"})
    monkeypatch.setattr(kernels, "_unavailable", {n: r for n, r in kernels._unavailable.items() if n != "flash"})
    saved = {name: sys.modules.pop(name) for name in _MODULES if name in sys.modules}
    attribute = kernels.__dict__.get("flash")
    yield monkeypatch
    for name in _MODULES:
        sys.modules.pop(name, None)
    sys.modules.update(saved)
    if attribute is None:
        kernels.__dict__.pop("flash", None)
    else:
        kernels.flash = attribute


@pytest.fixture
def fake_flash(isolated):
    """moba_hf.kernels.flash imported over the fake flash_attn (the registry sees it too)."""
    isolated.syspath_prepend(str(FAKE))
    module = importlib.import_module("moba_hf.kernels.flash")
    assert Path(sys.modules["flash_attn"].__file__).is_relative_to(FAKE)
    return module


@pytest.fixture
def flash(fake_flash, monkeypatch):
    """The backend over the fake, with its CUDA/half-precision input check switched off."""
    monkeypatch.setattr(fake_flash, "flash_attn_takes", lambda q: True)
    return fake_flash


def _load_fake():
    """The fake as a module of its own name, next to a real flash_attn."""
    spec = importlib.util.spec_from_file_location("fake_flash_attn_standin", FAKE / "flash_attn" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_matches_reference(flash, shape):
    q, k, v = _inputs(shape)
    _assert_matches_reference(flash.moba_attention_flash, q, k, v, block_size=shape[6], top_k=shape[7])


@pytest.mark.parametrize("gate", GATES, ids=_gate_id)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[8]], ids=_id)
def test_gate_options_match_reference(flash, shape, gate):
    q, k, v = _inputs(shape)
    _assert_matches_reference(
        flash.moba_attention_flash, q, k, v, **{"block_size": shape[6], "top_k": shape[7], **gate}
    )


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_nan_inf_propagate_like_reference(flash, which, value):
    """A row that sees a NaN / inf is non-finite as in the reference, the others are untouched."""
    for shape in (SHAPES[0], SHAPES[2]):
        assert_propagates_like_reference(flash.moba_attention_flash, shape, which, value)


def test_non_contiguous_inputs_and_scale(flash):
    """Transformers hands over q/k/v as transposed views of [B, N, H, D]; a custom scale must reach every call."""
    q, k, v = (torch.randn(2, 70, h, 8, dtype=torch.float64).transpose(1, 2).requires_grad_() for h in (4, 2, 2))
    _assert_matches_reference(flash.moba_attention_flash, q, k, v, block_size=16, top_k=3, scale=0.3)


def test_gradient_for_one_input_only(flash):
    """Only k needs a gradient (frozen q): the surrogate must still run and give the exact dk."""
    q, k, v = _inputs(SHAPES[0])
    q.requires_grad_(False)
    v.requires_grad_(False)
    kw = {"block_size": 16, "top_k": 3}
    grad = torch.randn(q.shape, dtype=q.dtype)
    (expected,) = torch.autograd.grad(call(moba_attention_reference, q, k, v, **kw), k, grad)
    (actual,) = torch.autograd.grad(call(flash.moba_attention_flash, q, k, v, **kw), k, grad)
    tol = rounding_tol(torch.float64, 63, 63, 16)
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def test_naive_lse_merge_gives_wrong_gradients(flash, monkeypatch):
    """Why the surrogate exists: merging with flash-attn's (gradient-free) lse gets the forward and dv right
    but dq and dk wrong."""
    monkeypatch.setattr(flash, "exact_lse_gradient", False)
    q, k, v = _inputs(SHAPES[0])
    kw = {"block_size": 16, "top_k": 3}
    grad = torch.randn(q.shape, dtype=q.dtype)
    expected = _fwd_bwd(moba_attention_reference, q, k, v, grad, **kw)
    naive = _fwd_bwd(flash.moba_attention_flash, q, k, v, grad, **kw)
    tol = rounding_tol(torch.float64, 63, 63, 16)
    torch.testing.assert_close(naive[0], expected[0], atol=tol, rtol=tol)
    torch.testing.assert_close(naive[3], expected[3], atol=tol, rtol=tol)
    for name, e, a in (("dq", expected[1], naive[1]), ("dk", expected[2], naive[2])):
        assert (a - e).abs().max() > 0.05 * e.abs().max(), f"{name}: the naive merge unexpectedly matched"


def test_flash_calls_per_case(flash, monkeypatch):
    """Cost as documented: 2 calls (own + gated) without gradients, 4 with, 1 when nothing is gated."""
    calls = []
    real = flash.flash_attn_varlen_func
    monkeypatch.setattr(flash, "flash_attn_varlen_func", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = _inputs(SHAPES[0])
    with torch.no_grad():
        call(flash.moba_attention_flash, q, k, v, block_size=16, top_k=3)
    assert len(calls) == 2
    call(flash.moba_attention_flash, q, k, v, block_size=16, top_k=3)
    assert len(calls) == 2 + 4
    call(flash.moba_attention_flash, q, k, v, block_size=16, top_k=1)
    assert len(calls) == 2 + 4 + 1


def test_low_precision_within_twice_torch_error(flash):
    """flash-attention's rule, here on the fake in bfloat16: the merge itself loses no precision."""
    _check_low_precision(flash.moba_attention_flash, "cpu")


def _check_low_precision(fn, device):
    """Error vs an fp32 reference at most 2x that of the same masked attention done naively in bfloat16."""
    kw = {"block_size": 32, "top_k": 3}
    cases = [(1, 8, 2, 200, 200, 64, 32, 3), (2, 4, 1, 70, 150, 64, 32, 3)]
    for shape in cases:
        q, k, v = _inputs(shape, torch.float32, device)
        grad = torch.randn(q.shape, device=device)
        exact = _fwd_bwd(moba_attention_reference, q, k, v, grad, **kw)
        low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
        baseline = _fwd_bwd(_naive_attention, *low, grad.bfloat16(), **kw)
        fast = _fwd_bwd(fn, *low, grad.bfloat16(), **kw)
        for name, e, b, f in zip(("out", "dq", "dk", "dv"), exact, baseline, fast, strict=True):
            assert f.dtype == torch.bfloat16, name
            err, base = (f.float() - e).abs().max(), (b.float() - e).abs().max()
            assert err <= 2 * base + flash_atol(e), (
                f"{_id(shape)} {name}: error {err:.3g} > 2 x bf16 torch error {base:.3g}"
            )


def _naive_attention(q, k, v, plan, scale=None):
    nq, nk, block_size = q.shape[2], k.shape[2], plan.block_size
    sel = selected_blocks(q, k, block_size=block_size, top_k=plan.top_k)
    key_pos = torch.arange(nk, device=q.device)
    q_pos = torch.arange(nk - nq, nk, device=q.device)
    allowed = sel[..., key_pos // block_size] & (key_pos[None, :] <= q_pos[:, None])
    g = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(g, dim=1).transpose(-1, -2) * q.shape[-1] ** -0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ v.repeat_interleave(g, dim=1)


def test_signature_equals_reference(fake_flash):
    assert inspect.signature(fake_flash.moba_attention_flash) == inspect.signature(moba_attention_reference)


def test_refuses_what_flash_attn_cannot_take(fake_flash):
    """CPU or float32/64 input: "auto" never picks it, an explicit call names what it needs."""
    q = torch.zeros(1, 2, 8, 16)
    fn = fake_flash.moba_attention_flash
    flash = kernels._REGISTRY["flash"]
    for t in (q, q.double(), q.bfloat16(), q.half()):
        assert not flash.auto_may_pick(t) and not flash.runs_on(t)
    with pytest.raises(ValueError, match="CUDA float16/bfloat16"):
        call(fn, q, q, q, block_size=4, top_k=2)


def test_bad_arguments_raise_value_error(flash):
    q, kv = torch.zeros(1, 2, 8, 8), torch.zeros(1, 3, 8, 8)
    with pytest.raises(ValueError, match="top_k"):
        call(flash.moba_attention_flash, q, q, q, block_size=4, top_k=0)
    with pytest.raises(ValueError, match="multiple"):
        call(flash.moba_attention_flash, q, kv, kv, block_size=4, top_k=2)


def test_registry_on_cpu_with_flash_attn_importable(fake_flash, caplog):
    """Importable but unable to run CPU tensors: "auto" skips it, an explicit request falls back once, logged."""
    q, k, v = _inputs((1, 2, 1, 40, 40, 8, 16, 3), requires_grad=False)
    assert kernels.backend_available("flash")
    assert resolve_backend("auto", q) == "torch"
    with caplog.at_level("WARNING", logger="moba_hf"):
        out = moba_attention(q, k, v, block_size=16, top_k=3, backend="flash")
        moba_attention(q, k, v, block_size=16, top_k=3, backend="flash")
    torch.testing.assert_close(out, call(moba_attention_torch, q, k, v, block_size=16, top_k=3), atol=0, rtol=0)
    assert len([r for r in caplog.records if "'flash'" in r.getMessage()]) == 1


@pytest.mark.skipif(HAS_FLASH_ATTN, reason="flash-attn is installed: nothing to fall back from")
def test_missing_flash_attn_falls_back_with_one_log_line(isolated, caplog):
    q, k, v = _inputs((1, 2, 1, 40, 40, 8, 16, 3), requires_grad=False)
    with caplog.at_level("WARNING", logger="moba_hf"):
        out = moba_attention(q, k, v, block_size=16, top_k=3, backend="flash")
        moba_attention(q, k, v, block_size=16, top_k=3, backend="flash")
    torch.testing.assert_close(out, call(moba_attention_torch, q, k, v, block_size=16, top_k=3), atol=0, rtol=0)
    assert not kernels.backend_available("flash") and resolve_backend("flash", q) == "torch"
    lines = [r.getMessage() for r in caplog.records if "'flash'" in r.getMessage()]
    assert len(lines) == 1 and "moba-hf[flash]" in lines[0], lines


def test_fake_follows_flash_attn_contract():
    """The stand-in against flash-attn's documented behaviour, checked with plain PyTorch."""
    fake = _load_fake()
    # two sequences, GQA 4:2, the first with seqlen_q = 2 < seqlen_k = 5 (bottom-right causal), a zero-length third
    lens_q, lens_k = [2, 3, 0], [5, 3, 4]
    cu_q = torch.tensor([0, 2, 5, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 8, 12], dtype=torch.int32)
    q = torch.randn(5, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(12, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(12, 2, 8, dtype=torch.float64, requires_grad=True)
    out, lse, _ = fake.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, causal=True, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (4, 5)
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k, strict=True)):
        if not nq:
            continue
        qs = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)  # [heads, nq, D]
        ks, vs = (t[cu_k[i] : cu_k[i + 1]].repeat_interleave(2, dim=1).transpose(0, 1) for t in (k, v))
        s = qs @ ks.transpose(-1, -2) * 8**-0.5
        mask = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + nk - nq  # the docs' bottom-right mask
        s = s.masked_fill(~mask, float("-inf"))
        torch.testing.assert_close(out[cu_q[i] : cu_q[i + 1]], (s.softmax(-1) @ vs).transpose(0, 1))
        torch.testing.assert_close(lse[:, cu_q[i] : cu_q[i + 1]], s.logsumexp(-1))
    # gradients come from `out` only: a loss on lse alone gives none
    assert lse.grad_fn is None or not torch.autograd.grad(lse.sum(), (q,), retain_graph=True)[0].abs().any()
    # an unpicked block (no query) gets zero dk/dv
    dk, dv = torch.autograd.grad(out.sum(), (k, v))
    assert not dk[8:].any() and not dv[8:].any()
    half = fake.flash_attn_varlen_func(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), cu_q, cu_k, 3, 5, return_attn_probs=True
    )
    assert half[0].dtype == torch.bfloat16 and half[1].dtype == torch.float32
    with pytest.raises(RuntimeError, match="one query per sequence"):
        fake.flash_attn_varlen_func(q[:1], k, v, torch.tensor([0, 1, 1], dtype=torch.int32), cu_k[:3], 1, 5)


@pytest.fixture
def real_flash(isolated):
    if not HAS_FLASH_ATTN:
        pytest.skip("needs flash-attn")
    return importlib.import_module("moba_hf.kernels.flash")


# (query lengths, key lengths): cut sequences, an empty one, Nq < Nk; and one query per sequence with GQA, which
# flash-attn runs on its own path (it swaps the query and head-group dimensions)
VARLEN_CASES = [([2, 68, 0, 1], [5, 75, 10, 110]), ([1, 1, 1], [7, 64, 130])]


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("lens", VARLEN_CASES, ids=["cut-and-empty", "one-query-each"])
def test_fake_matches_real_flash_attn(real_flash, lens, causal):
    """The stand-in and the real kernel on one varlen GQA call: outputs, lse and gradients (bf16 tolerance)."""
    fake, real = _load_fake(), sys.modules["flash_attn"]
    (cu_q, cu_k), longest = (
        [torch.tensor([0, *lengths], device="cuda").cumsum(0).int() for lengths in lens],
        [max(lengths) for lengths in lens],
    )
    q = torch.randn(int(cu_q[-1]), 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(int(cu_k[-1]), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    grad = torch.randn_like(q)
    results = []
    for lib in (fake, real):
        out, lse, _ = lib.flash_attn_varlen_func(q, k, v, cu_q, cu_k, *longest, causal=causal, return_attn_probs=True)
        results.append((out.float(), lse, *(g.float() for g in torch.autograd.grad(out, (q, k, v), grad))))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results, strict=True):
        assert a.shape == b.shape, name
        assert _close_bf16(a, b), f"{name}: max error {(a - b).abs().max():.3g}"


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4]], ids=_id)
def test_real_flash_attn_matches_reference(real_flash, shape):
    """Every piece of the backend on the real kernel, against the fp32 reference at bf16 tolerance (inputs rounded
    to bf16 first, so both select the same blocks)."""
    low = _inputs(shape, torch.bfloat16, "cuda")
    kw = {"block_size": shape[6], "top_k": shape[7]}
    grad = torch.randn(low[0].shape, device="cuda").bfloat16()
    exact = _fwd_bwd(moba_attention_reference, *(t.detach().float().requires_grad_() for t in low), grad.float(), **kw)
    fast = _fwd_bwd(real_flash.moba_attention_flash, *low, grad, **kw)
    for name, e, f in zip(("out", "dq", "dk", "dv"), exact, fast, strict=True):
        assert _close_bf16(f.float(), e), f"{name}: max error {(f.float() - e).abs().max():.3g}"


def _close_bf16(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within 4 bfloat16 roundings of the tensor's scale: each side carries its output's rounding (eps / 2) and that
    of the bf16 probabilities flash-attn feeds to P @ V (eps), plus flash-attention's fwd_atol slack."""
    eps = torch.finfo(torch.bfloat16).eps
    return bool((actual - expected).abs().max() <= 4 * eps * expected.abs().max() + flash_atol(expected))


@pytest.mark.cuda
def test_real_flash_attn_within_twice_torch_error(real_flash):
    assert kernels._REGISTRY["flash"].auto_may_pick(torch.zeros(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16))
    _check_low_precision(real_flash.moba_attention_flash, "cuda")
