"""Hostile inputs to the public kernel functions: NaN / inf, wrong dtypes and scales, parameters far beyond the
sequence. Every backend follows the reference's arithmetic: a row that sees a NaN is NaN, a row that cannot see it
is untouched (see `kernels.nonfinite.propagate_nonfinite`)."""

from __future__ import annotations

import re

import pytest
import torch
from kernel_cases import (
    CASES,
    call,
    call_dca,
    case_tol,
    fwd_bwd,
    moba_inputs,
    poisoned_inputs,
    rounding_tol,
    rows_that_see,
)
from kernel_cases import shape_id as _id

from moba_hf.dca import relative_positions
from moba_hf.integration.cache import BlockState
from moba_hf.kernels import (
    attend_plan,
    causal_attention,
    dense,
    moba_attention,
    moba_attention_reference,
    selected_blocks,
    torch_impl,
)
from moba_hf.kernels.decode import block_keys_from_cache, moba_decode
from moba_hf.kernels.dual_chunk_positions import MAX_MATRIX_LEN
from moba_hf.kernels.rope import default_inv_freq
from moba_hf.kernels.torch_impl import moba_attention_torch

NAN, INF = float("nan"), float("inf")
# (B, Hq, Hkv, Nq, Nk, D, block_size, top_k)
SHAPES = [
    CASES["odd"],  # GQA, partial last block, gated picks by max passes
    CASES["chunk"],  # Nq < Nk
    CASES["causal"],  # top_k >= blocks: causal (a fused kernel could zero NaN query rows here)
    (1, 2, 1, 300, 300, 8, 8, 5),  # many blocks, picks by topk
    (1, 2, 1, 520, 520, 8, 256, 2),  # own blocks in causal tiles of 128
]
# the torch backend's layouts, as in test_kernels: (fused CPU op, rows per key block before grouping, own tile)
LAYOUTS = {"chunked": (True, 1 << 40, 128), "grouped": (True, 0, 4), "matmul": (False, 0, 4)}


def _index(shape, which):
    nq, nk = shape[3], shape[4]
    return nq // 2 if which == "q" else nk - nq + nq // 2  # a key some queries see and some do not


def _same_nonfinite(actual, expected, tol):
    assert torch.equal(actual.isnan(), expected.isnan()), "NaN pattern differs"
    assert torch.equal(actual.isinf(), expected.isinf()), "inf pattern differs"
    finite = expected.isfinite()
    torch.testing.assert_close(actual[finite], expected[finite], atol=tol, rtol=tol)
    assert torch.equal(actual[~finite].isnan(), expected[~finite].isnan())


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_reference_nan_reaches_exactly_the_rows_that_see_it(shape, which):
    idx = _index(shape, which)
    q, k, v = poisoned_inputs(shape, which, idx)
    kw = {"block_size": shape[6], "top_k": shape[7]}
    bad = ~call(moba_attention_reference, q, k, v, **kw).isfinite().all(dim=-1)
    assert torch.equal(bad, rows_that_see(q, k, which, idx, **kw))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_torch_backend_propagates_like_reference(shape, which, value, layout, monkeypatch):
    fused, group_rows, own_tile = LAYOUTS[layout]
    monkeypatch.setattr(dense, "use_fused", fused)
    monkeypatch.setattr(torch_impl, "_GROUP_ROWS", group_rows)
    monkeypatch.setattr(torch_impl, "_OWN_TILE", own_tile)
    q, k, v = poisoned_inputs(shape, which, _index(shape, which), value)
    kw = {"block_size": shape[6], "top_k": shape[7]}
    with torch.no_grad():
        expected = call(moba_attention_reference, q, k, v, **kw)
        _same_nonfinite(call(moba_attention_torch, q, k, v, **kw), expected, case_tol(shape, torch.float64))


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=_id)
def test_torch_backend_finite_rows_keep_finite_gradients(shape, which):
    idx = _index(shape, which)
    q, k, v = poisoned_inputs(shape, which, idx)
    kw = {"block_size": shape[6], "top_k": shape[7]}
    out = call(moba_attention_torch, q, k, v, **kw)
    seen = rows_that_see(q, k, which, idx, **kw)
    assert torch.equal(~out.isfinite().all(dim=-1), seen)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert dq[~seen].isfinite().all()
    assert dk[1:].isfinite().all() and dv[1:].isfinite().all()  # the other batch row sees nothing
    last = shape[4] - shape[3] + int(seen[0].nonzero()[:, 1].max())  # position of the last row that saw it
    assert dk[0, :, last + 1 :].isfinite().all() and dv[0, :, last + 1 :].isfinite().all()


def test_a_nan_key_block_is_picked_by_the_gate():
    """A NaN pooled key ranks first (as in torch.max / topk), so the rows whose gate saw it attend it and show it."""
    q, k, _ = moba_inputs((1, 1, 1, 64, 64, 8, 8, 2), requires_grad=False)
    k[0, 0, 3, 0] = NAN  # block 0
    for top_k in (2, 5):  # one max pass / topk
        selected = selected_blocks(q, k, block_size=8, top_k=top_k)
        assert selected[0, 0, 8:, 0].all()  # every query after block 0 picked it
        assert selected[0, 0].sum(-1).le(top_k).all()


def test_decode_propagates_like_reference():
    shape = (2, 4, 2, 3, 40, 8, 8, 3)
    for which in ("q", "k", "v"):
        q, k, v = (t.detach() for t in poisoned_inputs(shape, which, 1 if which == "q" else 37))
        kw = {"block_size": 8, "top_k": 3}
        expected = call(moba_attention_reference, q, k, v, **kw)
        _same_nonfinite(moba_decode(q, k, v, block_keys_from_cache(k, 8), **kw), expected, case_tol(shape, q.dtype))


@pytest.mark.parametrize("block_size", [None, 4])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_dca_propagates_nan_only_to_rows_that_see_it(which, block_size):
    """DCA rows that see the NaN are NaN, the others equal the same run with the NaN replaced (all DCA paths)."""
    q, k, v = moba_inputs((1, 2, 1, 30, 30, 8, 4, 2), requires_grad=False)
    idx = 20
    kw = dict(pretraining_length=16, chunk_size=8, inv_freq=default_inv_freq(8, 10000.0), block_size=block_size)
    clean = call_dca(q, k, v, **kw)
    {"q": q, "k": k, "v": v}[which][0, 0, idx, 0] = NAN
    for grad in (False, True):  # the CPU inference paths, then the differentiable tiles
        with torch.set_grad_enabled(grad):
            args = [t.clone().requires_grad_(grad) for t in (q, k, v)]
            out = call_dca(*args, **kw).detach()
        bad = ~out.isfinite().all(dim=-1)
        if which == "q":
            assert bad[0, 0, idx] and bad.sum() == 1
        else:
            assert bad[0, :, idx:].any() and not bad[0, :, :idx].any()
        tol = rounding_tol(torch.float64, 30, 2 * 30, 8)  # RoPE moves add about position x eps
        torch.testing.assert_close(out[~bad], clean[~bad], atol=tol, rtol=tol)


# --- refusals ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_non_floating_inputs_are_refused(dtype):
    q, k, v = (torch.ones(1, 2, 8, 4, dtype=dtype) for _ in range(3))
    message = f"q must be a floating-point tensor \\(float16, bfloat16, float32, float64\\), got {dtype}"
    with pytest.raises(ValueError, match=message):
        moba_attention(q, k, v, block_size=4, top_k=2)
    with pytest.raises(ValueError, match="q must be a floating-point tensor"):
        causal_attention(q, k, v)
    with pytest.raises(ValueError, match="q must be a floating-point tensor"):
        moba_decode(q, k, v, torch.zeros(1, 2, 2, 4), block_size=4, top_k=2)


def test_mismatched_dtypes_and_devices_are_refused():
    q, k, v = moba_inputs((1, 2, 2, 8, 8, 4, 4, 2), requires_grad=False)
    with pytest.raises(ValueError, match="q, k, v must share one dtype, got q torch.float64, k torch.float32"):
        moba_attention(q, k.float(), v, block_size=4, top_k=2)
    with pytest.raises(ValueError, match="must share one dtype"):
        causal_attention(q, k, v.half())


@pytest.mark.parametrize("scale", [0, 0.0, -1.0, NAN, INF, -INF, "0.1", True, [0.1]])
def test_bad_scale_is_refused(scale):
    q, k, v = moba_inputs((1, 2, 2, 8, 8, 4, 4, 2), requires_grad=False)
    message = "scale must be None \\(head_dim \\*\\* -0.5\\) or a finite number > 0, got"
    with pytest.raises(ValueError, match=message):
        moba_attention(q, k, v, block_size=4, top_k=2, scale=scale)
    with pytest.raises(ValueError, match=message):
        causal_attention(q, k, v, scale=scale)
    with pytest.raises(ValueError, match=message):
        moba_decode(q[:, :, -1:], k, v, block_keys_from_cache(k, 4), block_size=4, top_k=2, scale=scale)
    with pytest.raises(ValueError, match=message):
        call_dca(q, k, v, pretraining_length=8, chunk_size=4, inv_freq=default_inv_freq(4, 1e4), scale=scale)


def test_good_scales_are_accepted():
    q, k, v = moba_inputs((1, 2, 2, 8, 8, 4, 4, 2), requires_grad=False)
    for scale in (1, 0.5, 1e-30):
        expected = call(moba_attention_reference, q, k, v, block_size=4, top_k=2, scale=scale)
        torch.testing.assert_close(moba_attention(q, k, v, block_size=4, top_k=2, scale=scale), expected)


# (Nq, Nk): a prefill (the fused causal kernel), a chunk after cached keys, one query
EDGE_SHAPES = [(24, 24), (10, 24), (1, 24)]


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("scale", [1e-300, 1e-46, 1e-40])
@pytest.mark.parametrize("nq,nk", EDGE_SHAPES)
def test_tiny_scale_averages_the_attended_values(nq, nk, scale, dtype, backend):
    """A scale too small for float32 scores (below 2**-150 it rounds to 0) makes every score 0 in the reference's
    arithmetic, and a subnormal one makes every exp() 1: each row averages the values it attends, as the
    reference and SDPA's math kernel compute; SDPA's fused CPU causal kernel (its -inf mask times a scale of 0)
    and with it the torch backend and the dense paths returned NaN."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=dtype) for n in (nq, nk, nk))
    prefix_mean = v.cumsum(dim=2) / torch.arange(1, nk + 1, dtype=dtype)[:, None]
    tol = rounding_tol(dtype, nk, nk, 8)
    for top_k in (2, 100):
        out = moba_attention(q, k, v, block_size=4, top_k=top_k, scale=scale, backend=backend)
        expected = call(moba_attention_reference, q, k, v, block_size=4, top_k=top_k, scale=scale)
        assert expected.isfinite().all()
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    dense = {
        "top_k covering every block": out,
        "causal_attention": causal_attention(q, k, v, scale=scale),
        "dense tail": moba_attention(q, k, v, block_size=4, top_k=2, scale=scale, backend=backend, dense_tail=nq),
    }
    for name, got in dense.items():
        torch.testing.assert_close(
            got, prefix_mean[:, :, nk - nq :], atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}"
        )
    grad = torch.randn(q.shape, generator=g, dtype=dtype)  # the backward's causal pieces take the same care
    kw = dict(block_size=4, top_k=2, scale=scale)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    want = fwd_bwd(moba_attention_reference, *leaves, grad, **kw)
    for name, got, w in zip(
        ("out", "dq", "dk", "dv"), fwd_bwd(_backend(backend), *leaves, grad, **kw), want, strict=True
    ):
        torch.testing.assert_close(got, w, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


def _backend(name):
    return lambda q, k, v, plan, scale: attend_plan(q, k, v, plan, scale, backend=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e39, 1e300])
def test_scale_past_float32_is_refused_where_scores_are_float32(scale, dtype):
    """Scores are float32 for float32 and 16-bit inputs: a larger scale would be inf there (every score inf or NaN,
    with NaN patterns that differ between kernels, SDPA's included)."""
    q, k, v = (t.to(dtype) for t in _qkv())
    message = (
        re.escape("scale must be at most 3.40282e+38") + f".* for {dtype} inputs, .*; got " + re.escape(repr(scale))
    )
    with pytest.raises(ValueError, match=message):
        moba_attention(q, k, v, block_size=4, top_k=2, scale=scale)
    with pytest.raises(ValueError, match="scale must be at most"):
        causal_attention(q, k, v, scale=scale)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_huge_scale_in_float64_follows_the_reference(backend):
    """float64 scores hold scale 1e300: the reference's finite result (the row's best key), on every backend."""
    q, k, v = (t.double() for t in _qkv(nq=24, nk=24))
    for top_k in (2, 100):
        expected = call(moba_attention_reference, q, k, v, block_size=4, top_k=top_k, scale=1e300)
        assert expected.isfinite().all()
        out = moba_attention(q, k, v, block_size=4, top_k=top_k, scale=1e300, backend=backend)
        torch.testing.assert_close(out, expected, atol=rounding_tol(torch.float64, 24, 24, 4), rtol=0)
    torch.testing.assert_close(causal_attention(q, k, v, scale=1e300), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("pooling", ["mean", "max", "mean+max", "bound"])
@pytest.mark.parametrize("value", [INF, -INF], ids=["inf", "-inf"])
@pytest.mark.parametrize("nq,nk", EDGE_SHAPES)
def test_top_k_covering_every_block_is_causal_attention_with_inf_keys(nq, nk, value, pooling, backend):
    """An inf key makes its block's gate score -inf for the queries pointing away from it: the block is still a
    candidate (ranked last), so top_k >= the blocks attends every earlier block, exactly causal attention, NaN
    and inf patterns included (a skipped block put finite rows 1.8 off). Blocks of 8 with top_k 3 pick by max
    passes, blocks of 4 with top_k 6 or 100 by topk."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (nq, nk, nk))
    k[0, 0, 5, 0] = value
    k[0, 1, 13, 3] = value
    expected = causal_attention(q, k, v)
    assert expected.isfinite().any(dim=-1).any() and expected.isnan().any()  # both kinds of rows occur
    tol = rounding_tol(torch.float64, nq, nk, 8)
    for block_size, top_k in ((8, 3), (4, 6), (4, 100)):
        out = moba_attention(q, k, v, block_size=block_size, top_k=top_k, pooling=pooling, backend=backend)
        _same_nonfinite(out, expected, tol)


def test_causal_attention_refuses_more_queries_than_keys():
    q, k, v = moba_inputs((1, 2, 2, 9, 8, 4, 4, 2), requires_grad=False)
    with pytest.raises(ValueError, match="need 1 <= Nq <= Nk"):
        causal_attention(q, k[:, :, :8], v[:, :, :8])


# --- memory follows the sequence ----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("block_size", [8, 10**7, 10**11])
def test_block_larger_than_sequence_is_one_block(backend, block_size):
    """Before: block_size 10**7 on 8 tokens allocated 314 MiB, 10**11 tried 3.2 TB. Now one block of 8 keys."""
    q, k, v = moba_inputs((1, 2, 1, 8, 8, 4, 8, 3), requires_grad=False)
    expected = causal_attention(q, k, v)
    for top_k in (1, 3):
        out = moba_attention(q, k, v, block_size=block_size, top_k=top_k, backend=backend)
        tol = rounding_tol(torch.float64, 8, 8, 4)
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    assert selected_blocks(q, k, block_size=block_size, top_k=3).shape == (1, 2, 8, 1)


def test_huge_block_in_decode_and_cache_state():
    q, k, v = moba_inputs((1, 2, 1, 2, 8, 4, 8, 3), requires_grad=False)
    state = BlockState(k, 10**11, "mean+max")
    state.append(k[:, :, :5], None)
    state.append(k[:, :, 5:], None)
    pooled = block_keys_from_cache(k, 10**11, "mean+max")
    tol = rounding_tol(torch.float64, 2, 8, 8, 4)
    torch.testing.assert_close(state.block_keys(), pooled, atol=tol, rtol=tol)
    out = moba_decode(q, k, v, pooled, block_size=10**11, top_k=3, pooling="mean+max")
    torch.testing.assert_close(out, causal_attention(q, k, v), atol=tol, rtol=tol)


def test_relative_positions_refuses_a_matrix_too_large_to_print():
    assert relative_positions(MAX_MATRIX_LEN, 4096, 1024).shape == (MAX_MATRIX_LEN, MAX_MATRIX_LEN)
    with pytest.raises(ValueError, match=f"seq_len must be <= {MAX_MATRIX_LEN} .* got 100000"):
        relative_positions(100_000, 4096, 1024)


@pytest.mark.slow
def test_flex_compiled_propagates_like_reference():
    """The compiled CPU flex forward (shape of test_kernels' compiled case, so the compile is shared)."""
    from moba_hf.kernels.flex import moba_attention_flex

    shape = (2, 4, 2, 63, 63, 16, 16, 3)
    for which in ("q", "k", "v"):
        q, k, v = (t.detach().float() for t in poisoned_inputs(shape, which, _index(shape, which)))
        with torch.no_grad():
            out = call(moba_attention_flex, q, k, v, block_size=16, top_k=3)
            expected = call(moba_attention_reference, q, k, v, block_size=16, top_k=3)
        assert torch.equal(out.isnan(), expected.isnan())
        finite = expected.isfinite()
        # float32 flash-style kernel vs float32 reference: a few eps per accumulated term (63 keys)
        tol = case_tol(shape, torch.float32)
        torch.testing.assert_close(out[finite], expected[finite], atol=tol, rtol=tol)


@pytest.mark.parametrize("shape", [(0, 2, 8, 4), (1, 2, 8, 0)], ids=["batch0", "head_dim0"])
def test_empty_batch_or_head_dim_is_refused(shape):
    x = torch.randn(shape)
    with pytest.raises(ValueError, match="batch \\(dim 0\\) and head_dim \\(dim 3\\) must be >= 1"):
        moba_attention(x, x, x, block_size=4, top_k=2)


def test_meta_tensors_are_refused():
    x = torch.empty(1, 2, 8, 4, device="meta")
    with pytest.raises(ValueError, match="got meta tensors"):
        moba_attention(x, x, x, block_size=4, top_k=2)


@pytest.mark.parametrize("temperature", [0.0, -1.0, NAN, INF, "2"])
def test_dca_bad_temperature_is_refused(temperature):
    q, k, v = moba_inputs((1, 2, 2, 8, 8, 4, 4, 2), requires_grad=False)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        call_dca(
            q, k, v, pretraining_length=8, chunk_size=4, inv_freq=default_inv_freq(4, 1e4), temperature=temperature
        )


def _qkv(b=1, hq=2, hkv=2, nq=8, nk=8, d=4):
    return torch.randn(b, hq, nq, d), torch.randn(b, hkv, nk, d), torch.randn(b, hkv, nk, d)


HOSTILE = {
    "block_size float": (lambda: moba_attention(*_qkv(), block_size=4.0, top_k=2), "block_size must be an integer"),
    "block_size bool": (lambda: moba_attention(*_qkv(), block_size=True, top_k=2), "block_size must be an integer"),
    "block_size numpy": (
        lambda: moba_attention(*_qkv(), block_size=__import__("numpy").int64(4), top_k=2),
        "block_size must be an integer",
    ),
    "backend": (lambda: moba_attention(*_qkv(), block_size=4, top_k=2, backend="cuda"), "backend must be one of"),
    "3-D": (lambda: moba_attention(*(t[0] for t in _qkv()), block_size=4, top_k=2), "q must be 4-D"),
    "k v shapes": (lambda: moba_attention(*_qkv()[:2], torch.randn(1, 2, 7, 4), block_size=4, top_k=2), "same shape"),
    "batch mismatch": (lambda: moba_attention(_qkv(b=2)[0], *_qkv()[1:], block_size=4, top_k=2), "must agree"),
    "gqa 3 of 2": (lambda: moba_attention(*_qkv(hq=3), block_size=4, top_k=2), "multiple of key/value heads"),
    "zero heads": (lambda: moba_attention(*_qkv(hq=0, hkv=0), block_size=4, top_k=2), "query heads \\(dim 1\\)"),
    "zero query heads": (lambda: moba_attention(*_qkv(hq=0), block_size=4, top_k=2), "query heads \\(dim 1\\) must be"),
    "zero query heads, reference": (
        lambda: moba_attention(*_qkv(hq=0), block_size=4, top_k=2, backend="reference"),
        "query heads \\(dim 1\\) must be >= 1, got q shape \\(1, 0, 8, 4\\)",
    ),
    "zero query heads, causal": (lambda: causal_attention(*_qkv(hq=0)), "query heads \\(dim 1\\) must be >= 1"),
    "Nq 0": (lambda: moba_attention(*_qkv(nq=0), block_size=4, top_k=2), "need 1 <= Nq <= Nk"),
    "Nk 0": (lambda: moba_attention(*_qkv(nq=0, nk=0), block_size=4, top_k=2), "need 1 <= Nq <= Nk"),
    "decode starts": (
        lambda: moba_decode(*_qkv(nq=1), torch.zeros(1, 2, 2, 4), block_size=4, top_k=2, starts=torch.tensor([8])),
        "starts must be",
    ),
    "decode block_keys width": (
        lambda: moba_decode(*_qkv(nq=1), torch.zeros(1, 2, 2, 3), block_size=4, top_k=2),
        "block_keys must be",
    ),
    "decode too few blocks": (
        lambda: moba_decode(*_qkv(nq=1), torch.zeros(1, 2, 1, 4), block_size=4, top_k=2),
        "the sequences need 2",
    ),
    "dca inv_freq": (
        lambda: call_dca(*_qkv(), pretraining_length=8, chunk_size=4, inv_freq=torch.ones(3)),
        "inv_freq must have shape",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_arguments_are_refused(case):
    call, message = HOSTILE[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_huge_top_k_sink_and_local_are_causal_attention():
    q, k, v = (t.double() for t in _qkv(nq=20, nk=20))
    expected = causal_attention(q, k, v)
    tol = rounding_tol(torch.float64, 20, 20, 4)
    for gate in ({"top_k": 10**18}, {"top_k": 1, "sink_blocks": 10**18}, {"top_k": 1, "local_blocks": 10**18}):
        out = moba_attention(q, k, v, block_size=4, backend="torch", **gate)
        torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
