"""Every MoBA backend against the reference: forward and gradients, awkward shapes, gate options, bad input."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import SHAPES, call, case_tol, flash_atol, rounding_tol, selection
from kernel_cases import fwd_bwd as _fwd_bwd
from kernel_cases import gate_id as _gate_id
from kernel_cases import moba_inputs as _inputs
from kernel_cases import shape_id as _id

from moba_hf import kernels
from moba_hf.kernels import dense, moba_attention, moba_attention_reference, resolve_backend, torch_impl
from moba_hf.kernels.torch_impl import moba_attention_torch

BACKEND_MODULES = {
    "torch": ("moba_hf.kernels.torch_impl", "moba_attention_torch"),
    "flex": ("moba_hf.kernels.flex", "moba_attention_flex"),
}
UNAVAILABLE_ON_CPU = ("triton", "flash")  # CUDA-only backends: triton needs GPU tensors, flash needs flash-attn + GPU

GATES = [
    {},
    {"pooling": "max", "sink_blocks": 1},
    {"pooling": "mean+max", "local_blocks": 1},
    {"pooling": "bound", "sink_blocks": 1, "local_blocks": 1},
    {"pooling": "bound", "sink_blocks": 1, "top_p": 0.5, "min_top_k": 2},  # an adaptive budget
]


def _assert_matches_reference(fn, shape, gate, dtype=torch.float64):
    q, k, v = _inputs(shape, dtype)
    atol = rtol = case_tol(shape, dtype)
    kw = {"block_size": shape[6], "top_k": shape[7], **gate}
    if "min_top_k" in kw:  # the adaptive budget's floor, within each case's top_k (top_k = 1 cases included)
        kw["min_top_k"] = min(kw["min_top_k"], kw["top_k"])
    grad = torch.randn(q.shape, dtype=dtype)
    expected = _fwd_bwd(moba_attention_reference, q, k, v, grad, **kw)
    actual = _fwd_bwd(fn, q, k, v, grad, **kw)
    for name, e, a in zip(("out", "dq", "dk", "dv"), expected, actual, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape, name
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(autouse=True)
def _nan_filled_outputs(monkeypatch):
    """Uninitialised output buffers start as NaN, so a row the kernel forgets to write cannot pass."""
    monkeypatch.setattr(
        torch_impl, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    )


# the torch backend's layouts (fused call, rows per key block before grouping, own-block tile): gated pieces in
# fused padded chunks, fused one call per key block, plain matmuls; own blocks whole (the default tile of 128
# exceeds these blocks) or in causal tiles of 4 rows plus earlier-tile pieces (blocks of 8, 16, 20, 64)
LAYOUTS = {"chunked": (True, 1 << 40, 128), "grouped": (True, 0, 4), "matmul": (False, 0, 4)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gate", GATES, ids=_gate_id)
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_torch_matches_reference_float64(shape, gate, layout, monkeypatch):
    fused, group_rows, own_tile = LAYOUTS[layout]
    monkeypatch.setattr(dense, "use_fused", fused)
    monkeypatch.setattr(torch_impl, "_GROUP_ROWS", group_rows)
    monkeypatch.setattr(torch_impl, "_OWN_TILE", own_tile)
    _assert_matches_reference(moba_attention_torch, shape, gate)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gate", GATES[::3], ids=_gate_id)
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[3] >= 30], ids=_id)
def test_torch_query_parts_match_reference(shape, gate, layout, parts, monkeypatch):
    # queries cut into ranges run on single-threaded workers (parts of 5+ rows here), forward and gradients,
    # in every layout (own blocks in causal tiles included)
    fused, group_rows, own_tile = LAYOUTS[layout]
    monkeypatch.setattr(dense, "use_fused", fused)
    monkeypatch.setattr(torch_impl, "_GROUP_ROWS", group_rows)
    monkeypatch.setattr(torch_impl, "_OWN_TILE", own_tile)
    monkeypatch.setattr(torch_impl, "_PART_ROWS", 5)
    monkeypatch.setattr(torch_impl, "worker_count", lambda device: parts)
    ranges = torch_impl.query_parts(shape[3], shape[4], shape[6], parts)
    assert len(ranges) == parts and ranges[0][0] == 0 and ranges[-1][1] == shape[3]
    _assert_matches_reference(moba_attention_torch, shape, gate)


def test_query_parts_cut_at_block_boundaries():
    assert torch_impl.query_parts(4096, 4096, 512, 2) == [(0, 2048), (2048, 4096)]
    assert torch_impl.query_parts(1500, 1500, 512, 2) == [(0, 512), (512, 1500)]  # nearest boundary
    assert torch_impl.query_parts(1536, 1536, 512, 3) == [(0, 512), (512, 1024), (1024, 1536)]
    assert torch_impl.query_parts(1400, 1700, 64, 2) == [(0, 724), (724, 1400)]  # queries start at key 300
    assert torch_impl.query_parts(1000, 1000, 512, 1) == [(0, 1000)]
    assert torch_impl.query_parts(600, 600, 64, 2) == [(0, 600)]  # parts of at least 512 queries


def test_query_parts_balance_attended_keys():
    # a query attends at most top_k blocks but scores every earlier block: the first part, whose queries see
    # fewer keys and blocks, holds more of them
    assert torch_impl.query_parts(4096, 4096, 64, 2, top_k=12) == [(0, 2304), (2304, 4096)]
    assert torch_impl.query_parts(8192, 8192, 64, 2, top_k=12) == [(0, 4672), (4672, 8192)]
    assert torch_impl.query_parts(131072, 131072, 512, 2, top_k=3) == [(0, 72192), (72192, 131072)]
    # every block selected: work grows with the position, so the first part is the longer one (by area: 1/sqrt 2)
    assert torch_impl.query_parts(4096, 4096, 64, 2, top_k=64) == [(0, 2880), (2880, 4096)]
    assert torch_impl.query_parts(4096, 4096, 64, 2) == [(0, 2048), (2048, 4096)]  # no top_k: equal sizes


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("rebase", [20.0, 0.5], ids=["default", "every-call"])
@pytest.mark.parametrize("layout", ["chunked", "grouped"])
def test_torch_gated_blocks_far_above_the_own_block(layout, rebase, dtype, monkeypatch):
    """Gated pieces accumulate against the own block's log-sum-exp; pieces scoring hundreds above it (e^100
    overflows float32) move that reference up (every call with a small `_REBASE`) and must neither overflow nor
    lose precision."""
    fused, group_rows, own_tile = LAYOUTS[layout]
    monkeypatch.setattr(torch_impl, "_GROUP_ROWS", group_rows)
    monkeypatch.setattr(torch_impl, "_OWN_TILE", own_tile)
    monkeypatch.setattr(torch_impl, "_REBASE", rebase)
    shape = (2, 4, 2, 150, 150, 16, 16, 4)
    q, k, v = (t.detach() for t in _inputs(shape, torch.float64))
    k[:, :, :40] *= 60  # early blocks score ~+-100 and more against later queries
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    atol = rtol = case_tol(shape, dtype)
    kw = {"block_size": 16, "top_k": 4}
    grad = torch.randn(q.shape, dtype=dtype)
    expected = _fwd_bwd(moba_attention_reference, q, k, v, grad, **kw)
    actual = _fwd_bwd(moba_attention_torch, q, k, v, grad, **kw)
    for name, e, a in zip(("out", "dq", "dk", "dv"), expected, actual, strict=True):
        scale = 1 + float(e.detach().abs().max())  # dq / dk carry the keys' and queries' scale
        torch.testing.assert_close(a, e, atol=atol * scale, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("shape", SHAPES[:3], ids=_id)
def test_torch_matches_reference_float32(shape):
    _assert_matches_reference(moba_attention_torch, shape, {}, dtype=torch.float32)


@pytest.mark.parametrize("group_rows", [1 << 40, 0], ids=["chunked", "grouped"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 97, 97, 8, 8, 4), (1, 4, 1, 61, 130, 8, 8, 3)], ids=_id)
def test_torch_tiny_chunks(shape, group_rows, monkeypatch):
    """Tiny chunk / batch / gate-slice sizes: padding rows, many fused calls, key blocks split over several
    calls, many gate slices."""
    monkeypatch.setattr(torch_impl, "_GROUP_ROWS", group_rows)
    monkeypatch.setattr(torch_impl, "_CHUNK_MIN", 4)
    monkeypatch.setattr(torch_impl, "_CHUNK_MAX", 4)
    monkeypatch.setattr(torch_impl, "_BATCH_ROWS", 12)
    monkeypatch.setattr(torch_impl, "_GATE_ELEMENTS", 400)
    monkeypatch.setattr(torch_impl, "_OWN_TILE", 2)
    _assert_matches_reference(moba_attention_torch, shape, {"sink_blocks": 1})


def test_torch_non_contiguous_inputs():
    """Transformers hands over q/k/v as transposed views of [B, N, H, D]."""
    q = torch.randn(2, 70, 4, 8, dtype=torch.float64).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 70, 2, 8, dtype=torch.float64).transpose(1, 2).requires_grad_()
    v = torch.randn(2, 70, 2, 8, dtype=torch.float64).transpose(1, 2).requires_grad_()
    grad = torch.randn(2, 4, 70, 8, dtype=torch.float64)
    kw = {"block_size": 16, "top_k": 3}
    expected = _fwd_bwd(moba_attention_reference, q, k, v, grad, **kw)
    actual = _fwd_bwd(moba_attention_torch, q, k, v, grad, **kw)
    tol = rounding_tol(torch.float64, 70, 70, 8)
    for e, a in zip(expected, actual, strict=True):
        torch.testing.assert_close(a, e, atol=tol, rtol=tol)


def test_torch_bfloat16_within_twice_torch_error():
    """flash-attention's rule: error vs an fp32 reference at most 2x that of a same-dtype PyTorch computation."""
    shape = (1, 4, 2, 200, 200, 32, 32, 3)
    q, k, v = _inputs(shape, torch.float32, requires_grad=False)
    kw = {"block_size": 32, "top_k": 3}
    exact = call(moba_attention_reference, q, k, v, **kw)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    # same-dtype PyTorch computation: the reference's attention on bf16 inputs, rounded to bf16
    rounded = call(moba_attention_reference, qb.float(), kb.float(), vb.float(), **kw)
    baseline = (rounded.bfloat16().float() - exact).abs()
    fast = call(moba_attention_torch, qb, kb, vb, **kw)
    assert fast.dtype == torch.bfloat16
    assert (fast.float() - exact).abs().max() <= 2 * baseline.max() + flash_atol(exact)


def test_all_blocks_equals_causal_sdpa():
    q, k, v = _inputs((2, 6, 2, 90, 90, 16, 8, 64), requires_grad=False)
    out = call(moba_attention_torch, q, k, v, block_size=8, top_k=64)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    tol = rounding_tol(torch.float64, 90, 90, 16)
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_own_block_only_is_block_diagonal():
    q, k, v = _inputs((1, 2, 2, 48, 48, 8, 16, 1), requires_grad=False)
    out = call(moba_attention_torch, q, k, v, block_size=16, top_k=1)
    for c in range(3):
        sl = slice(16 * c, 16 * (c + 1))
        expected = F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True)
        tol = rounding_tol(torch.float64, 16, 16, 8)
        torch.testing.assert_close(out[:, :, sl], expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", sorted(BACKEND_MODULES))
def test_backend_signature_equals_reference(name):
    module, func = BACKEND_MODULES[name]
    fn = getattr(importlib.import_module(module), func)
    assert inspect.signature(fn) == inspect.signature(moba_attention_reference)


@pytest.mark.parametrize("name", UNAVAILABLE_ON_CPU, ids=lambda n: f"{n}_missing")
def test_missing_backend_falls_back_with_one_log_line(name, caplog, monkeypatch):
    q, k, v = _inputs((1, 2, 1, 40, 40, 8, 16, 3), requires_grad=False)
    with caplog.at_level("WARNING", logger="moba_hf"):
        out = moba_attention(q, k, v, block_size=16, top_k=3, backend=name)
        moba_attention(q, k, v, block_size=16, top_k=3, backend=name)
    torch.testing.assert_close(out, call(moba_attention_reference, q, k, v, block_size=16, top_k=3))
    assert resolve_backend(name, q) == "torch"
    assert len([r for r in caplog.records if name in r.getMessage()]) == 1


def _flex_mask_dense(q, k, **kw):
    from moba_hf.kernels import flex

    nq, nk = q.shape[2], k.shape[2]
    gate = kernels.GateOptions(**{n: v for n, v in kw.items() if n not in ("block_size", "top_k")})
    picks, _ = flex._selection(q, k, kw["block_size"], kw["top_k"], gate)
    mod = flex._mask_mod(picks, kw["block_size"], nk - nq, kw["top_k"])
    b = torch.arange(q.shape[0])[:, None, None, None]
    h = torch.arange(q.shape[1])[None, :, None, None]
    return mod(b, h, torch.arange(nq)[None, None, :, None], torch.arange(nk)[None, None, None, :])


@pytest.mark.parametrize("gate", GATES, ids=_gate_id)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[3], SHAPES[7]], ids=_id)
def test_flex_mask_equals_reference_selection(shape, gate):
    """The per-token mask_mod and the tile-level BlockMask agree with the shared selection (no compile needed)."""
    from moba_hf.kernels.flex import moba_block_mask

    q, k, _ = _inputs(shape, requires_grad=False)
    kw = {"block_size": shape[6], "top_k": shape[7], **gate}
    nq, nk, bs = q.shape[2], k.shape[2], shape[6]
    sel = selection(q, k, **kw)
    key_pos, q_pos = torch.arange(nk), torch.arange(nk - nq, nk)
    expected = sel[..., key_pos // bs] & (key_pos[None, :] <= q_pos[:, None])
    assert torch.equal(_flex_mask_dense(q, k, **kw), expected)
    mask = moba_block_mask(q, k, block_size=shape[6], top_k=shape[7], gate=kernels.GateOptions(**gate))
    tiles = mask.to_dense().bool()  # [B, H, q tiles, kv tiles]: every allowed pair must lie in a visited tile
    qt, kt = mask.BLOCK_SIZE
    visited = tiles[..., torch.arange(nq) // qt, :][..., torch.arange(nk) // kt]
    assert not (expected & ~visited).any()


def test_flex_cpu_gradients_use_torch_backend(caplog, monkeypatch):
    """flex has no CPU backward: asked for by name with gradients, the registry runs "torch" (one log line).
    float32: FlexAttention's CPU kernel has no float64 (test_flex covers that fallback)."""
    from moba_hf.kernels.flex import moba_attention_flex

    with caplog.at_level("WARNING", logger="moba_hf"):
        flex = lambda q, k, v, plan, scale: kernels.attend_plan(q, k, v, plan, scale, backend="flex")  # noqa: E731
        _assert_matches_reference(flex, SHAPES[0], {}, dtype=torch.float32)
    assert any("'flex'" in r.getMessage() and "backward" in r.getMessage() for r in caplog.records)
    q = torch.zeros(1, 1, 4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="no CPU backward"):
        call(moba_attention_flex, q, q, q, block_size=4, top_k=1)


_REGISTERED_CALLS: list[int] = []


def registered_backend(q, k, v, plan, scale=None):
    _REGISTERED_CALLS.append(plan.block_size)
    return moba_attention_reference(q, k, v, plan, scale)


def test_registered_backend_runs_end_to_end(monkeypatch):
    """A backend added with register_backend is a valid name for moba_attention and MobaConfig, and "auto"
    ranks it like the built-in ones."""
    from moba_hf.config import MobaConfig

    monkeypatch.setattr(kernels, "_REGISTRY", dict(kernels._REGISTRY))
    monkeypatch.setattr(kernels, "_loaded", dict(kernels._loaded))
    _REGISTERED_CALLS.clear()
    kernels.register_backend(kernels.Backend("mine", f"{__name__}:registered_backend", auto_rank=0))
    assert "mine" in kernels.BACKENDS and MobaConfig(backend="mine").backend == "mine"
    q, k, v = _inputs(SHAPES[0], torch.float64, requires_grad=False)
    out = moba_attention(q, k, v, block_size=16, top_k=3, backend="mine")
    torch.testing.assert_close(out, call(moba_attention_reference, q, k, v, block_size=16, top_k=3), atol=0, rtol=0)
    assert resolve_backend("auto", q) == "mine" and _REGISTERED_CALLS == [16]
    with pytest.raises(ValueError, match="auto"):
        kernels.register_backend(kernels.Backend("auto", "x:y"))


@pytest.mark.slow
def test_flex_forward_matches_reference_cpu_compiled():
    """One tiny compiled case (the first CPU compile takes minutes)."""
    from moba_hf.kernels.flex import moba_attention_flex

    q, k, v = _inputs((2, 4, 2, 63, 63, 16, 16, 3), torch.float32, requires_grad=False)
    out = call(moba_attention_flex, q, k, v, block_size=16, top_k=3)
    tol = rounding_tol(torch.float32, 63, 63, 16)
    torch.testing.assert_close(out, call(moba_attention_reference, q, k, v, block_size=16, top_k=3), atol=tol, rtol=tol)


def test_moba_attention_dispatch_and_auto_on_cpu():
    q, k, v = _inputs((1, 2, 1, 40, 40, 8, 16, 3), requires_grad=False)
    assert resolve_backend("auto", q) == "torch"
    expected = call(moba_attention_reference, q, k, v, block_size=16, top_k=3)
    torch.testing.assert_close(moba_attention(q, k, v, block_size=16, top_k=3, backend="torch"), expected)
    torch.testing.assert_close(moba_attention(q, k, v, block_size=16, top_k=3), expected)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 0, "top_k": 3}, "block_size"),
        ({"block_size": 16, "top_k": 0}, "top_k"),
        ({"block_size": 16, "top_k": 3, "pooling": "min"}, "pooling"),
        ({"block_size": 16, "top_k": 3, "sink_blocks": -1}, "sink_blocks"),
        ({"block_size": 16, "top_k": 3, "local_blocks": 1.5}, "local_blocks"),
    ],
)
def test_torch_bad_arguments(kwargs, match):
    q, k, v = _inputs((1, 2, 1, 8, 8, 4, 4, 2), requires_grad=False)
    with pytest.raises(ValueError, match=match):
        call(moba_attention_torch, q, k, v, **kwargs)


def test_torch_bad_shapes():
    q = torch.randn(1, 3, 8, 4)
    k = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="multiple"):
        call(moba_attention_torch, q, k, k, block_size=4, top_k=2)
    with pytest.raises(ValueError, match="Nq"):
        call(moba_attention_torch, torch.randn(1, 2, 9, 4), k, k, block_size=4, top_k=2)
