"""Dual Chunk Attention without transformers: position remapping, dense DCA and DCA + MoBA against
references built from unrotated q / k with explicitly remapped positions (float64)."""

import math

import pytest
import torch
from kernel_cases import call, call_dca, rounding_tol, selection

from moba_hf.dca import relative_positions, rotate
from moba_hf.kernels import moba_attention_reference
from moba_hf.kernels.dual_chunk_positions import format_matrix

# every float64 case here: Nq, Nk <= 50, head_dim <= 8; RoPE moves add about position x eps, hence 2 Nk
TOL = rounding_tol(torch.float64, 50, 2 * 50, 8)


def rule_positions(i: int, j: int, c: int, s: int) -> tuple[int, int]:
    """(query position, key position) of the pair (i, j), straight from DCA's three rules."""
    if i // s == j // s:
        return i % s, j % s
    if i // s - j // s == 1:
        return min(s + i % s, c - 1), j % s
    return c - 1, j % s


def test_example_row():
    assert relative_positions(13, 8, 6)[12].tolist() == [7, 6, 5, 4, 3, 2, 6, 5, 4, 3, 2, 1, 0]


@pytest.mark.parametrize("n,c,s", [(13, 8, 6), (40, 9, 5), (33, 16, 12), (20, 4, 1), (17, 30, 29), (5, 8, 6)])
def test_relative_positions_brute_force(n, c, s):
    got = relative_positions(n, c, s)
    for i in range(n):
        for j in range(i + 1):
            qp, kp = rule_positions(i, j, c, s)
            assert got[i, j] == qp - kp, (i, j)
    assert int(got.max()) <= c - 1
    assert bool((got.tril() >= 0).all())


def test_short_sequence_is_plain_distance():
    n = 6
    idx = torch.arange(n)
    assert torch.equal(relative_positions(n, 8, 6).tril(), (idx[:, None] - idx[None, :]).tril())


@pytest.mark.parametrize("args", [(10, 8, 8), (10, 8, 0), (10, 8, 9), (0, 8, 4), (10, 1, 1)])
def test_relative_positions_bad_args(args):
    with pytest.raises(ValueError, match="chunk_size|seq_len|pretraining_length"):
        relative_positions(*args)


def test_format_matrix_marks_chunks():
    text = format_matrix(relative_positions(13, 8, 6), 6)
    assert text.splitlines()[12].split(": ")[1] == "7 6 5 4 3 2 | 6 5 4 3 2 1 | 0"


# --- attention -------------------------------------------------------------------------------------------


def inv_freq_for(d: int) -> torch.Tensor:
    return 1.0 / (100.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))


def rope_complex(x: torch.Tensor, pos: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Independent RoPE for one vector [..., D]: dims (d, d + D/2) as a complex number times e^(i pos f_d)."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(inv_freq), pos * inv_freq)
    return torch.cat([z.real, z.imag], dim=-1)


def remapped_scores(q_raw, k_raw, c, s, inv_freq):
    """[B, Hq, Nq, Nk] dot products with every pair rotated at its explicit DCA positions (queries = last Nq)."""
    b, hq, nq, d = q_raw.shape
    hkv, nk = k_raw.shape[1], k_raw.shape[2]
    k_rep = k_raw.repeat_interleave(hq // hkv, dim=1)
    out = torch.zeros(b, hq, nq, nk, dtype=q_raw.dtype)
    for t in range(nq):
        i = nk - nq + t
        for j in range(i + 1):
            qp, kp = rule_positions(i, j, c, s)
            out[:, :, t, j] = (
                rope_complex(q_raw[:, :, t], qp, inv_freq) * rope_complex(k_rep[:, :, j], kp, inv_freq)
            ).sum(-1)
    return out


def reference_dca(q_raw, k_raw, v, c, s, inv_freq, scale, allowed=None):
    nq, nk = q_raw.shape[2], k_raw.shape[2]
    scores = remapped_scores(q_raw, k_raw, c, s, inv_freq) * scale
    causal = torch.arange(nk)[None, :] <= torch.arange(nk - nq, nk)[:, None]
    mask = causal if allowed is None else causal & allowed
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return probs @ v.repeat_interleave(q_raw.shape[1] // v.shape[1], dim=1)


def dca_inputs(q_raw, k_raw, s, inv_freq):
    """What the cache and attention hold: q rotated at i mod s, k at j mod s."""
    nq, nk = q_raw.shape[2], k_raw.shape[2]
    q = rotate(q_raw, torch.arange(nk - nq, nk) % s, inv_freq)
    k = rotate(k_raw, torch.arange(nk) % s, inv_freq)
    return q, k


CASES = [
    # B, Hq, Hkv, Nq, Nk, D, c, s
    (1, 2, 2, 37, 37, 8, 16, 12),
    (2, 4, 2, 41, 41, 6, 9, 5),
    (1, 3, 1, 1, 30, 8, 10, 7),  # decode, MQA
    (2, 4, 2, 9, 29, 4, 12, 8),  # chunked prefill
    (1, 2, 1, 26, 26, 8, 30, 29),  # one chunk boundary only
]


def case_id(case):
    b, hq, hkv, nq, nk, d, c, s = case
    return f"B{b}-HQ{hq}-H{hkv}-Q{nq}-K{nk}-D{d}-c{c}-s{s}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_dense_dca_matches_remapped_reference(case):
    b, hq, hkv, nq, nk, d, c, s = case
    inv_freq = inv_freq_for(d)
    q_raw = torch.randn(b, hq, nq, d, dtype=torch.float64, requires_grad=True)
    k_raw = torch.randn(b, hkv, nk, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, nk, d, dtype=torch.float64, requires_grad=True)
    scale = 0.7
    want = reference_dca(q_raw, k_raw, v, c, s, inv_freq, scale)
    q, k = dca_inputs(q_raw, k_raw, s, inv_freq)
    got = call_dca(q, k, v, pretraining_length=c, chunk_size=s, inv_freq=inv_freq, scale=scale)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)

    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q_raw, k_raw, v), grad)
    got_grads = torch.autograd.grad(got, (q_raw, k_raw, v), grad)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("fused", [True, False], ids=["by-parts", "stacked"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_dense_dca_inference_path_matches_remapped_reference(case, fused, monkeypatch):
    # without gradients, dense DCA runs one attention call per part and merges by log-sum-exp
    from moba_hf.kernels import dense

    monkeypatch.setattr(dense, "use_fused", fused)
    b, hq, hkv, nq, nk, d, c, s = case
    inv_freq = inv_freq_for(d)
    q_raw = torch.randn(b, hq, nq, d, dtype=torch.float64)
    k_raw = torch.randn(b, hkv, nk, d, dtype=torch.float64)
    v = torch.randn(b, hkv, nk, d, dtype=torch.float64)
    want = reference_dca(q_raw, k_raw, v, c, s, inv_freq, 0.7)
    q, k = dca_inputs(q_raw, k_raw, s, inv_freq)
    with torch.no_grad():
        got = call_dca(q, k, v, pretraining_length=c, chunk_size=s, inv_freq=inv_freq, scale=0.7)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_small_tiles_give_the_same_result(monkeypatch):
    from moba_hf.kernels import dual_chunk as dca_module

    inv_freq = inv_freq_for(8)
    q = torch.randn(2, 4, 35, 8, dtype=torch.float64)
    k = torch.randn(2, 2, 35, 8, dtype=torch.float64)
    v = torch.randn(2, 2, 35, 8, dtype=torch.float64)
    args = dict(pretraining_length=12, chunk_size=9, inv_freq=inv_freq)
    whole = call_dca(q, k, v, **args)
    monkeypatch.setattr(dca_module, "TILE_ELEMENTS", 2 * 4 * 35 * 4)  # 4-query tiles
    torch.testing.assert_close(call_dca(q, k, v, **args), whole, rtol=TOL, atol=TOL)


def test_temperature_scales_logits():
    inv_freq = inv_freq_for(8)
    q_raw = torch.randn(1, 2, 30, 8, dtype=torch.float64)
    k_raw = torch.randn(1, 2, 30, 8, dtype=torch.float64)
    v = torch.randn(1, 2, 30, 8, dtype=torch.float64)
    c, s = 10, 8
    factor = 0.1 * math.log(30 / c) + 1
    want = reference_dca(q_raw, k_raw, v, c, s, inv_freq, 8**-0.5 * factor)
    q, k = dca_inputs(q_raw, k_raw, s, inv_freq)
    got = call_dca(q, k, v, pretraining_length=c, chunk_size=s, inv_freq=inv_freq, temperature=factor)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_one_chunk_equals_plain_causal_attention():
    inv_freq = inv_freq_for(8)
    q = torch.randn(2, 4, 20, 8, dtype=torch.float64)
    k = torch.randn(2, 2, 20, 8, dtype=torch.float64)
    v = torch.randn(2, 2, 20, 8, dtype=torch.float64)
    got = call_dca(q, k, v, pretraining_length=32, chunk_size=24, inv_freq=inv_freq)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


# --- DCA + MoBA ------------------------------------------------------------------------------------------


def reference_selection(scores_raw, nk, block_size, top_k):
    """MoBA selection applied to remapped scores: gate(i, b) = mean over the block's keys of q_variant . k."""
    b, hq, nq, _ = scores_raw.shape
    nb = -(-nk // block_size)
    selected = torch.zeros(b, hq, nq, nb, dtype=torch.bool)
    for t in range(nq):
        i = nk - nq + t
        own = i // block_size
        gates = (
            torch.stack(
                [scores_raw[:, :, t, blk * block_size : (blk + 1) * block_size].mean(-1) for blk in range(own)], -1
            )
            if own
            else None
        )
        selected[:, :, t, own] = True
        if own and top_k > 1:
            top = gates.topk(min(top_k - 1, own), dim=-1).indices
            selected[:, :, t].scatter_(-1, top, True)
    return selected


MOBA_CASES = [
    # B, Hq, Hkv, Nq, Nk, D, c, s, block, top_k
    (1, 2, 2, 45, 45, 8, 16, 12, 4, 3),
    (2, 4, 2, 39, 39, 6, 10, 6, 3, 2),
    (1, 4, 1, 1, 50, 8, 13, 10, 5, 3),  # decode
    (2, 2, 1, 11, 34, 4, 12, 8, 4, 4),  # chunked prefill
    (1, 2, 2, 30, 30, 8, 9, 8, 4, 1),  # own block only
    (1, 2, 2, 29, 29, 8, 9, 8, 4, 99),  # top_k covers everything: dense DCA
]


@pytest.mark.parametrize(
    ("group_rows", "own_tile", "score_elements", "parts"),
    [(1 << 40, 128, 1 << 24, 1), (0, 2, 1 << 24, 1), (1 << 40, 128, 1, 1), (0, 2, 40, 3)],
    ids=["chunked", "grouped-tiled", "one-row-gate-slices", "three-worker-ranges"],
)
@pytest.mark.parametrize("case", MOBA_CASES, ids=lambda c: case_id(c[:8]) + f"-blk{c[8]}-k{c[9]}")
def test_dca_moba_inference_path_matches_moba_on_remapped_scores(
    case, group_rows, own_tile, score_elements, parts, monkeypatch
):
    # without gradients on CPU, DCA + MoBA runs the torch kernel's gathered blocks with per-region query variants,
    # each worker selecting the blocks of its query range (grouped-tiled: gated pieces one call per key block, own
    # blocks in causal tiles of 2 rows; one-row gate slices: the selection scores one query at a time, so slices
    # end inside chunks as well as at their edges; three worker ranges: ranges of 5+ queries, cut anywhere)
    from moba_hf.kernels import dual_chunk as dca_kernels
    from moba_hf.kernels import torch_impl

    monkeypatch.setattr(torch_impl, "_GROUP_ROWS", group_rows)
    monkeypatch.setattr(torch_impl, "_OWN_TILE", own_tile)
    monkeypatch.setattr(dca_kernels, "_SCORE_ELEMENTS", score_elements)
    monkeypatch.setattr(dca_kernels, "_PART_SCORE_ELEMENTS", score_elements)
    monkeypatch.setattr(torch_impl, "_PART_ROWS", 5)
    monkeypatch.setattr(torch_impl, "worker_count", lambda device: parts)
    b, hq, hkv, nq, nk, d, c, s, block, top_k = case
    inv_freq = inv_freq_for(d)
    q_raw = torch.randn(b, hq, nq, d, dtype=torch.float64)
    k_raw = torch.randn(b, hkv, nk, d, dtype=torch.float64)
    v = torch.randn(b, hkv, nk, d, dtype=torch.float64)
    selected = reference_selection(remapped_scores(q_raw, k_raw, c, s, inv_freq), nk, block, top_k)
    want = reference_dca(q_raw, k_raw, v, c, s, inv_freq, 0.3, selected[..., torch.arange(nk) // block])
    q, k = dca_inputs(q_raw, k_raw, s, inv_freq)
    with torch.no_grad():
        got = call_dca(
            q, k, v, pretraining_length=c, chunk_size=s, inv_freq=inv_freq, scale=0.3, block_size=block, top_k=top_k
        )
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_torch_kernel_with_one_query_variant_is_plain_moba():
    from moba_hf.kernels import moba_attention_reference
    from moba_hf.kernels.torch_impl import attention_with_query_variants

    q = torch.randn(2, 4, 37, 8, dtype=torch.float64)
    k = torch.randn(2, 2, 53, 8, dtype=torch.float64)
    v = torch.randn(2, 2, 53, 8, dtype=torch.float64)
    gate = dict(block_size=5, top_k=3, sink_blocks=1, local_blocks=1)
    selected = selection(q, k, **gate)
    got = attention_with_query_variants([q], k, v, selected=selected, block_size=5, variant_chunk=10, scale=0.4)
    want = call(moba_attention_reference, q, k, v, scale=0.4, **gate)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


def test_torch_kernel_with_query_variants_rejects_bad_arguments():
    from moba_hf.kernels import selected_blocks
    from moba_hf.kernels.torch_impl import attention_with_query_variants

    q, k = torch.randn(1, 2, 20, 8), torch.randn(1, 1, 20, 8)
    selected = selected_blocks(q, k, block_size=5, top_k=2)
    ok = dict(selected=selected, block_size=5, variant_chunk=10, scale=0.3)
    with pytest.raises(ValueError, match="variant_chunk must be a positive multiple of block_size"):
        attention_with_query_variants([q, q], k, k, **{**ok, "variant_chunk": 12})
    with pytest.raises(ValueError, match="queries must be 1 to 3"):
        attention_with_query_variants([q] * 4, k, k, **ok)
    with pytest.raises(ValueError, match="selected must be bool"):
        attention_with_query_variants([q], k, k, **{**ok, "selected": selected[..., :2]})


@pytest.mark.parametrize("case", MOBA_CASES, ids=lambda c: case_id(c[:8]) + f"-blk{c[8]}-k{c[9]}")
def test_dca_moba_matches_moba_on_remapped_scores(case):
    b, hq, hkv, nq, nk, d, c, s, block, top_k = case
    inv_freq = inv_freq_for(d)
    q_raw = torch.randn(b, hq, nq, d, dtype=torch.float64, requires_grad=True)
    k_raw = torch.randn(b, hkv, nk, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, nk, d, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        selected = reference_selection(remapped_scores(q_raw, k_raw, c, s, inv_freq), nk, block, top_k)
    allowed = selected[..., torch.arange(nk) // block]
    want = reference_dca(q_raw, k_raw, v, c, s, inv_freq, d**-0.5, allowed)
    q, k = dca_inputs(q_raw, k_raw, s, inv_freq)
    got = call_dca(q, k, v, pretraining_length=c, chunk_size=s, inv_freq=inv_freq, block_size=block, top_k=top_k)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    grad = torch.randn_like(want)
    got_grads = torch.autograd.grad(got, (q_raw, k_raw, v), grad)
    for g, w in zip(got_grads, torch.autograd.grad(want, (q_raw, k_raw, v), grad), strict=True):
        torch.testing.assert_close(g, w, rtol=TOL, atol=TOL)
    if top_k >= -(-nk // block):
        dense = call_dca(q, k, v, pretraining_length=c, chunk_size=s, inv_freq=inv_freq)
        torch.testing.assert_close(got, dense, rtol=TOL, atol=TOL)


@pytest.mark.parametrize(
    "sink,local,pooling,top_p",
    [(0, 0, "mean", None), (1, 0, "mean", None), (0, 1, "mean", None), (1, 2, "mean", None), (0, 1, "bound", None),
     (1, 0, "bound", 0.5), (0, 0, "mean", 0.8)],
)  # fmt: skip
def test_dca_moba_in_one_chunk_equals_moba_reference(sink, local, pooling, top_p):
    inv_freq = inv_freq_for(8)
    q = torch.randn(2, 4, 27, 8, dtype=torch.float64)
    k = torch.randn(2, 2, 27, 8, dtype=torch.float64)
    v = torch.randn(2, 2, 27, 8, dtype=torch.float64)
    moba = dict(
        block_size=4,
        top_k=3 if top_p is None else 5,
        sink_blocks=sink,
        local_blocks=local,
        pooling=pooling,
        top_p=top_p,
    )
    got = call_dca(q, k, v, pretraining_length=40, chunk_size=32, inv_freq=inv_freq, **moba)
    torch.testing.assert_close(got, call(moba_attention_reference, q, k, v, **moba), rtol=TOL, atol=TOL)


def test_chunk_size_must_be_multiple_of_block_size():
    q = torch.randn(1, 2, 10, 8)
    with pytest.raises(ValueError, match="multiple of block_size"):
        call_dca(q, q, q, pretraining_length=12, chunk_size=6, inv_freq=inv_freq_for(8), block_size=4)


def test_bfloat16_runs_in_float32_and_returns_bfloat16():
    inv_freq = inv_freq_for(8).float()
    q = torch.randn(1, 2, 30, 8)
    k = torch.randn(1, 2, 30, 8)
    v = torch.randn(1, 2, 30, 8)
    args = dict(pretraining_length=10, chunk_size=7, inv_freq=inv_freq)
    got = call_dca(q.bfloat16(), k.bfloat16(), v.bfloat16(), **args)
    assert got.dtype == torch.bfloat16
    # bf16 runs in float32 and rounds once on return: float32 on the bf16-rounded inputs, then one bf16 rounding
    rounded = call_dca(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), **args)
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(got.float(), rounded, rtol=eps, atol=rounding_tol(torch.float32, 30, 30, 8))


def test_empty_parts_with_very_negative_logits_stay_finite():
    """top_k = 1 leaves the successive / inter parts empty; logits far below 0 must not underflow the merge."""
    inv_freq = inv_freq_for(8)
    k = torch.randn(1, 1, 1, 8).expand(1, 1, 24, 8).contiguous()
    q = -100 * k[:, :, -10:].repeat(1, 2, 1, 1)  # scores around -100 * |k|^2 * scale, far below -100
    v = torch.randn(1, 1, 24, 8)
    got = call_dca(q, k, v, pretraining_length=9, chunk_size=8, inv_freq=inv_freq, block_size=4, top_k=1)
    assert torch.isfinite(got).all()
