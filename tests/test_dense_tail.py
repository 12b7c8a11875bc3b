"""The dense tail: the last queries of a prompt (or a chunk of one) attend every earlier key while the rest of the
prefill stays sparse; in the kernels (forward, gradients, NaN), DCA, the models, the cache and the sparsity count."""

from __future__ import annotations

import pytest
import tiny_models
import torch
from kernel_cases import CASES, call, call_dca, case_tol, moba_inputs, model_tol, rounding_tol, selection
from kernel_cases import shape_id as _id

import moba_hf
from moba_hf import DcaConfig, MobaConfig
from moba_hf.integration import sparsity
from moba_hf.kernels import BlockPlan, moba_attention, moba_attention_reference
from moba_hf.kernels.rope import default_inv_freq

SHAPES = [CASES[name] for name in ("odd", "chunk", "own-block", "causal", "decode")]
GATE = {"pooling": "bound", "sink_blocks": 1, "local_blocks": 1}


def expected(q, k, v, tail, **kw):
    """The reference's MoBA rows, and its plain causal attention for the last `tail` rows (one block holding every
    key, attended causally: no gate, so a key scoring -inf cannot drop a block)."""
    t = min(tail, q.shape[2])
    sparse = call(moba_attention_reference, q, k, v, **kw)
    dense = call(moba_attention_reference, q, k, v, **{**kw, "block_size": k.shape[2], "top_k": 1})
    return torch.cat([sparse[:, :, : q.shape[2] - t], dense[:, :, q.shape[2] - t :]], dim=2)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("tail", [1, 7, "all", "more"])
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_kernel_tail_rows_attend_densely_forward_and_gradients(shape, tail, backend):
    q, k, v = moba_inputs(shape)
    nq = shape[3]
    tail = {"all": nq, "more": nq + 5}.get(tail, tail)
    kw = dict(block_size=shape[6], top_k=shape[7], **GATE)
    grad = torch.randn(q.shape, dtype=q.dtype)
    want = expected(q, k, v, tail, **kw)
    got = moba_attention(q, k, v, backend=backend, dense_tail=tail, **kw)
    tol = case_tol(shape, q.dtype)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    grads = torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)
    for name, g, w in zip("qkv", *grads, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=lambda m, n=name: f"d{n}: {m}")


def test_tail_changes_the_tail_rows_only():
    shape = (1, 2, 1, 64, 64, 8, 8, 2)
    q, k, v = moba_inputs(shape, requires_grad=False)
    kw = dict(block_size=8, top_k=2)
    sparse = moba_attention(q, k, v, **kw)
    tailed = moba_attention(q, k, v, dense_tail=10, **kw)
    tol = case_tol(shape, q.dtype)  # the kernel may cut the shorter call into other parts: rounding only
    torch.testing.assert_close(tailed[:, :, :54], sparse[:, :, :54], rtol=tol, atol=tol)
    assert (tailed[:, :, 54:] - sparse[:, :, 54:]).abs().amax() > 1e-3  # the last rows see blocks MoBA skipped


@pytest.mark.parametrize("which,index", [("v", 3), ("v", 40), ("k", 5), ("q", 60), ("q", 10)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nan_and_inf_propagate_as_in_the_reference(which, index, bad):
    shape = (1, 2, 1, 64, 64, 8, 8, 2)
    q, k, v = moba_inputs(shape, requires_grad=False)
    {"q": q, "k": k, "v": v}[which][0, 0, index, 0] = bad
    kw = dict(block_size=8, top_k=2)
    got = moba_attention(q, k, v, dense_tail=12, backend="torch", **kw)
    torch.testing.assert_close(got, expected(q, k, v, 12, **kw), rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("tail", [64, 100])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_tail_covering_every_query_keeps_a_bad_value_in_the_rows_attending_it(bad, tail, backend):
    """dense_tail >= Nq runs dense causal attention for every row: a NaN / inf value reaches only the rows at or
    after it (SDPA's causal kernel spread 0 * NaN to the rows before it)."""
    shape = (1, 2, 1, 64, 64, 8, 8, 2)
    q, k, v = moba_inputs(shape, requires_grad=False)
    v[0, 0, 40, 1] = bad
    kw = dict(block_size=8, top_k=2)
    want = expected(q, k, v, tail, **kw)
    assert want[:, :, :40].isfinite().all() and not want[:, :, 40:, 1].isfinite().any()
    got = moba_attention(q, k, v, dense_tail=tail, backend=backend, **kw)
    tol = case_tol(shape, q.dtype)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)


@pytest.mark.parametrize("tail", [-1, 1.5, True, "4"])
def test_bad_tail_is_refused(tail):
    q, k, v = moba_inputs((1, 2, 1, 8, 8, 4, 4, 1), requires_grad=False)
    with pytest.raises(ValueError, match=r"dense_tail must be an integer >= 0, got"):
        moba_attention(q, k, v, block_size=4, top_k=1, dense_tail=tail)
    with pytest.raises(ValueError, match=r"dense_tail must be an integer >= 0, got"):
        MobaConfig(dense_tail=tail)


def test_tail_only_call_still_checks_the_moba_arguments():
    q, k, v = moba_inputs((1, 2, 1, 8, 8, 4, 4, 1), requires_grad=False)
    with pytest.raises(ValueError, match="top_k must be an integer >= 1, got 0"):
        moba_attention(q, k, v, block_size=4, top_k=0, dense_tail=8)
    with pytest.raises(ValueError, match="pooling"):
        moba_attention(q, k, v, block_size=4, top_k=1, pooling="median", dense_tail=8)


# --- DCA ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nq,nk,tail", [(50, 50, 9), (20, 47, 20), (30, 45, 3)])
def test_dca_tail_rows_run_dense_dca(nq, nk, tail):
    gen = torch.Generator().manual_seed(nq + nk)
    q = torch.randn(1, 4, nq, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(1, 2, nk, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(1, 2, nk, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    dca = dict(pretraining_length=16, chunk_size=12, inv_freq=default_inv_freq(8, 1e4), temperature=1.2)
    moba = dict(block_size=4, top_k=2, **GATE)
    got = call_dca(q, k, v, dense_tail=tail, **dca, **moba)
    # over all keys: the sparse rows see no later key, the dense tail every earlier one
    sparse, dense = call_dca(q, k, v, **dca, **moba), call_dca(q, k, v, **dca)
    want = torch.cat([sparse[:, :, : nq - tail], dense[:, :, nq - tail :]], dim=2)
    tol = rounding_tol(torch.float64, nq, 2 * nk, 8)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    grad = torch.randn(q.shape, dtype=q.dtype, generator=gen)
    grads = torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)
    for g, w in zip(*grads, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


# --- the count ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nq,nk,tail", [(40, 40, 5), (17, 61, 17), (30, 61, 50), (1, 61, 8)])
def test_rule_pairs_count_the_tail_as_causal(nq, nk, tail):
    q, k = torch.randn(1, 2, nq, 8), torch.randn(1, 1, nk, 8)
    kw = dict(block_size=8, top_k=2, **GATE)
    selected = selection(q, k, **kw).clone()
    t = min(tail, nq)
    selected[:, :, nq - t :] = True  # dense rows: every block (causally)
    want = sparsity.attended_pairs(selected, nk, 8)
    assert 2 * BlockPlan.build(8, 2, sink_blocks=1, local_blocks=1, dense_tail=t).attended_pairs(nq, nk) == want


def test_config_tail_per_call_and_theoretical_sparsity():
    cfg = MobaConfig(block_size=8, top_k=2, dense_tail=6)
    assert [cfg.tail_queries(n) for n in (1, 2, 6, 100)] == [0, 2, 6, 6]  # a decode step keeps `decode`
    assert cfg.plan(1).dense_tail == 0 and cfg.plan(50).dense_tail == 6  # the decode step's plan has no tail
    for n in (5, 40, 61):
        causal = n * (n + 1) // 2
        q, k = torch.randn(1, 1, n, 8), torch.randn(1, 1, n, 8)
        selected = selection(q, k, block_size=8, top_k=2).clone()
        selected[:, :, n - min(6, n) :] = True  # the dense tail
        attended = sparsity.attended_pairs(selected, n, 8)
        assert cfg.theoretical_sparsity(n) == pytest.approx(1 - attended / causal)
    assert MobaConfig(block_size=8, top_k=2, dense_tail=40).theoretical_sparsity(40) == 0.0
    assert MobaConfig.from_dict({"moba": {"dense_tail": 64}}).dense_tail == 64
    assert "dense_tail=64" in str(MobaConfig(dense_tail=64))


# --- models -------------------------------------------------------------------------------------------------------
TAILED = MobaConfig(block_size=4, top_k=2, dense_tail=6)


def test_model_tail_covering_the_prompt_equals_dense(one_thread):
    model = tiny_models.tiny_model("llama")
    ids = torch.randint(0, 97, (1, 30))
    want = model(ids).logits
    moba_hf.apply(model, MobaConfig(block_size=4, top_k=2, dense_tail=30))
    torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=model_tol(tiny_models.TINY, 30))
    moba_hf.apply(model, TAILED)
    assert (model(ids).logits - want).abs().max() > 1e-3  # the head rows stay sparse


def test_model_sparsity_counts_the_tail_and_decode_stays_sparse(one_thread):
    model = tiny_models.tiny_model("llama", TAILED)
    ids = torch.randint(0, 97, (1, 40))
    with moba_hf.track_sparsity() as stats:
        model(ids)
    for value in stats.per_layer().values():
        assert value == pytest.approx(TAILED.theoretical_sparsity(40))
    assert TAILED.theoretical_sparsity(40) < MobaConfig(block_size=4, top_k=2).theoretical_sparsity(40)
    out = model(ids, use_cache=True)
    step = torch.randint(0, 97, (1, 1))
    with moba_hf.track_sparsity() as stats:
        model(step, past_key_values=out.past_key_values, use_cache=True)
    assert set(stats.backends.values()) == {"decode"}  # one new token: the sparse decode step, no dense tail


def test_model_cached_multi_token_step_runs_its_tail_densely(one_thread):
    model = tiny_models.tiny_model("llama", TAILED)
    ids = torch.randint(0, 97, (1, 44))
    out = model(ids[:, :40], use_cache=True)
    with moba_hf.track_sparsity() as stats:
        model(ids[:, 40:], past_key_values=out.past_key_values, use_cache=True)
    assert stats.per_layer() and all(value == 0.0 for value in stats.per_layer().values())  # 4 rows, tail of 6


def test_model_left_padded_batch_equals_single_sequences(one_thread):
    model = tiny_models.tiny_model("llama", TAILED, pad_token_id=0)
    seqs = [torch.randint(1, 97, (n,)) for n in (23, 9, 16)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, width - len(s) :], mask[row, width - len(s) :] = s, 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # generate's: RoPE angles as in the unpadded sequences
    batched = model(ids, attention_mask=mask, position_ids=positions).logits
    for row, s in enumerate(seqs):
        single = model(s[None]).logits[0]
        torch.testing.assert_close(batched[row, width - len(s) :], single, rtol=0, atol=model_tol(tiny_models.TINY, 23))


def test_model_dca_tail_covering_the_prompt_equals_dense_dca(one_thread):
    dca = DcaConfig(chunk_size=12)
    ids = torch.randint(0, 97, (1, 40))
    dense = tiny_models.tiny_model("llama", MobaConfig(sparse=False, dca=dca), max_position_embeddings=16)
    want = dense(ids).logits
    tailed = tiny_models.tiny_model("llama", MobaConfig(block_size=4, top_k=2, dca=dca, dense_tail=40),
                                 max_position_embeddings=16)  # fmt: skip
    tailed.load_state_dict(dense.state_dict())
    torch.testing.assert_close(tailed(ids).logits, want, rtol=0, atol=1e-9)
