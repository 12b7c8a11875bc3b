"""Sparse decode over the KV cache: the kernel, the running block state, cached decoding == one full forward."""

import inspect

import pytest
import torch
from conftest import ARCHS, TINY, tiny_model
from kernel_cases import model_tol, rounding_tol
from transformers import (
    AttentionInterface,
    DynamicCache,
    LlamaForCausalLM,
)
from transformers.masking_utils import AttentionMaskInterface

import moba_hf
from moba_hf import MobaConfig
from moba_hf.integration import cache as moba_cache
from moba_hf.integration.register import moba_mask
from moba_hf.kernels import GateOptions, causal_attention, moba_attention_reference
from moba_hf.kernels.decode import block_keys_from_cache, moba_decode

# --- the kernel ---------------------------------------------------------------------------------------------------
# (B, Hq, Hkv, Nk, Nq, D, block, top_k, pooling, sink, local)
KERNEL_CASES = [
    (2, 4, 2, 37, 1, 8, 5, 3, "mean", 0, 0),
    (1, 6, 2, 64, 3, 16, 8, 2, "max", 1, 0),
    (3, 4, 1, 50, 2, 8, 7, 4, "mean+max", 0, 1),
    (2, 2, 2, 9, 1, 4, 16, 3, "mean", 0, 0),  # block >= sequence: dense
    (2, 4, 2, 40, 4, 8, 4, 1, "mean", 0, 0),  # own block only
    (1, 8, 8, 111, 1, 60, 16, 9, "mean", 0, 0),  # top_k >= blocks
    (3, 4, 2, 63, 5, 8, 6, 2, "mean", 2, 1),
    (2, 6, 3, 45, 2, 8, 5, 3, "bound", 1, 1),
]


def _case_id(c):
    b, hq, hkv, nk, nq, d, bs, k, pool, sink, local = c
    return f"B{b}-T{nk}-Q{nq}-H{hkv}-HQ{hq}-D{d}-blk{bs}-k{k}-{pool}-s{sink}l{local}"


@pytest.mark.parametrize("case", KERNEL_CASES, ids=_case_id)
def test_decode_kernel_matches_reference_per_row(case):
    b, hq, hkv, nk, nq, d, bs, k, pool, sink, local = case
    q = torch.randn(b, hq, nq, d, dtype=torch.float64)
    keys = torch.randn(b, hkv, nk, d, dtype=torch.float64)
    values = torch.randn_like(keys)
    starts = torch.tensor([0, 3, 7][:b])  # left padding of different widths
    gate = dict(block_size=bs, top_k=k, pooling=pool, sink_blocks=sink, local_blocks=local)
    out = moba_decode(q, keys, values, block_keys_from_cache(keys, bs, pool, starts), starts=starts, **gate)
    for r in range(b):
        s = int(starts[r])
        want = moba_attention_reference(q[r : r + 1], keys[r : r + 1, :, s:], values[r : r + 1, :, s:], **gate)
        tol = rounding_tol(torch.float64, nq, nk, d)
        torch.testing.assert_close(out[r : r + 1], want, rtol=tol, atol=tol)


def test_decode_kernel_float32_and_bad_args():
    q = torch.randn(1, 4, 1, 16)
    keys, values = torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)
    out = moba_decode(q, keys, values, block_keys_from_cache(keys, 8), block_size=8, top_k=3)
    want = moba_attention_reference(q, keys, values, block_size=8, top_k=3)
    assert out.dtype == torch.float32
    tol = rounding_tol(torch.float32, 1, 70, 16)
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="top_k must be an integer >= 1, got 0"):
        moba_decode(q, keys, values, block_keys_from_cache(keys, 8), block_size=8, top_k=0)
    with pytest.raises(ValueError, match="block_keys"):
        moba_decode(q, keys, values, block_keys_from_cache(keys, 8)[:, :, :3], block_size=8, top_k=3)


# --- the running block state ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("pooling", ["mean", "max", "mean+max", "bound"])
def test_block_state_equals_recomputation_after_every_append(pooling):
    bs, b, hkv, d = 4, 3, 2, 5
    keys = torch.randn(b, hkv, 40, d, dtype=torch.float64)
    real = torch.ones(b, 40, dtype=torch.bool)
    real[1, :3] = False  # left padding
    real[2, :9] = False
    state = moba_cache.BlockState(keys, bs, pooling)
    n = 0
    for chunk in (11, 1, 1, 7, 1, 1, 1, 5, 12):  # prefill, decode steps and chunks crossing blocks
        state.append(keys[:, :, n : n + chunk], real[:, n : n + chunk])
        n += chunk
        assert state.n == n and state.contiguous_rows()
        assert state.counts.tolist() == real[:, :n].sum(-1).tolist()
        want = block_keys_from_cache(keys[:, :, :n], bs, pooling, state.starts)
        # a block's sum of bs keys, added in another order: bs roundings of the largest key
        tol = rounding_tol(torch.float64, bs) * float(keys.abs().max())
        torch.testing.assert_close(state.block_keys(), want, rtol=0, atol=tol)


def test_block_state_notices_a_gap():
    keys = torch.randn(1, 1, 6, 2)
    state = moba_cache.BlockState(keys, 4, "mean")
    state.append(keys[:, :, :4], torch.tensor([[True, True, False, False]]))  # right padding
    assert not state.contiguous_rows()


# --- tiny models: cached decoding == one forward without cache ------------------------------------------------------
MODEL_TOL = model_tol(TINY, 45)  # sequences here are at most 45 tokens
# the forward's cache keyword: "cache" in transformers >= 5.2x, "past_key_values" before
CACHE = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


class Spy:
    """Counts sparse decode calls and block-state (re)builds while active."""

    def __init__(self, monkeypatch):
        self.decodes = 0
        self.builds = 0
        real_decode, real_init = moba_cache.moba_decode, moba_cache.BlockState.__init__

        def decode(*args, **kwargs):
            self.decodes += 1
            return real_decode(*args, **kwargs)

        def init(state, *args, **kwargs):
            self.builds += 1
            real_init(state, *args, **kwargs)

        monkeypatch.setattr(moba_cache, "moba_decode", decode)
        monkeypatch.setattr(moba_cache.BlockState, "__init__", init)


_ORACLE = "moba_test_full_decode_oracle"
_oracle_dense = [0, None]


def _full_decode_oracle(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """No cache: dense causal for the queries in positions [first, end) (decode="full": all after the prompt),
    MoBA for the others."""
    out, _ = moba_hf.integration.moba_attention_forward(module, query, key, value, attention_mask, scaling, **kwargs)
    dense = causal_attention(query, key, value, scale=scaling).transpose(1, 2)
    first, end = _oracle_dense
    end = out.shape[1] if end is None else end
    return torch.cat([out[:, :first], dense[:, first:end], out[:, end:]], dim=1), None


def _full_forward(model, ids, decode, prompt, dense_end=None):
    if decode == "moba" and dense_end is None:
        return model(ids).logits
    AttentionInterface.register(_ORACLE, _full_decode_oracle)
    AttentionMaskInterface.register(_ORACLE, moba_mask)
    _oracle_dense[:] = [prompt, dense_end]
    model.set_attn_implementation(_ORACLE)
    try:
        return model(ids).logits
    finally:
        model.set_attn_implementation("moba")


@pytest.mark.parametrize("decode", ["moba", "full"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_stepwise_cached_decoding_equals_full_forward(arch, decode, monkeypatch):
    moba = MobaConfig(block_size=5, top_k=2, decode=decode)
    model = tiny_model(arch, moba)
    spy = Spy(monkeypatch)
    ids = torch.randint(0, 97, (2, 29))  # 6 blocks, the last one partial
    prompt = 8
    with torch.no_grad():
        want = _full_forward(model, ids, decode, prompt)
        cache = DynamicCache(config=model.config)
        got = [model(ids[:, :prompt], **{CACHE: cache}, use_cache=True).logits]
        for t in range(prompt, ids.shape[1]):
            got.append(model(ids[:, t : t + 1], **{CACHE: cache}, use_cache=True).logits)
            if decode == "moba":  # the running block means equal a recomputation after every step
                for layer, state in getattr(cache, moba_cache._STATE_ATTR).items():
                    keys = cache.layers[layer].keys
                    tol = rounding_tol(torch.float64, 5) * float(keys.abs().max())  # bs roundings, as above
                    torch.testing.assert_close(state.block_keys(), block_keys_from_cache(keys, 5), rtol=0, atol=tol)
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=MODEL_TOL, atol=MODEL_TOL)
    steps = ids.shape[1] - prompt
    if decode == "moba":
        layers = model.config.num_hidden_layers
        assert (spy.decodes, spy.builds) == (steps * layers, layers)  # built once, then only appended to
    else:
        assert spy.decodes == 0


def test_steps_below_the_crossover_run_dense_and_the_first_sparse_step_builds_the_block_state(monkeypatch):
    # crossover 4 blocks of 5: a step whose cache holds <= 15 tokens (positions 8..14) is dense, later ones sparse
    monkeypatch.setenv("MOBA_HF_DECODE_CROSSOVER", "4")
    model = tiny_model("llama", MobaConfig(block_size=5, top_k=2, decode="moba"))
    spy = Spy(monkeypatch)
    ids = torch.randint(0, 97, (2, 29))
    prompt = 8
    with torch.no_grad():
        want = _full_forward(model, ids, "moba", prompt, dense_end=15)
        cache = DynamicCache(config=model.config)
        got = [model(ids[:, :prompt], **{CACHE: cache}, use_cache=True).logits]
        for t in range(prompt, ids.shape[1]):
            got.append(model(ids[:, t : t + 1], **{CACHE: cache}, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=MODEL_TOL, atol=MODEL_TOL)
    layers = model.config.num_hidden_layers
    assert (spy.decodes, spy.builds) == ((29 - 15) * layers, layers)  # built once, at the first sparse step


def test_crossover_is_measured_once_per_setting(monkeypatch):
    from moba_hf.kernels import decode as decode_kernels

    monkeypatch.delenv("MOBA_HF_DECODE_CROSSOVER")
    monkeypatch.setattr(decode_kernels, "_crossovers", {})
    lengths = []

    def times(q, hkv, n, **kw):  # sparse wins from 4096 keys on
        lengths.append(n)
        return (1.0, 2.0) if n >= 4096 else (2.0, 1.0)

    monkeypatch.setattr(decode_kernels, "step_times", times)
    q, k = torch.zeros(1, 4, 1, 8), torch.zeros(1, 2, 9, 8)
    gate = GateOptions(sink_blocks=1)
    found = decode_kernels.decode_crossover(q, k, block_size=256, top_k=3, gate=gate)
    assert (found, lengths) == (20, [1280, 2560, 5120])  # from top_k + sink + 1 = 5 blocks, doubling
    assert decode_kernels.decode_crossover(q, k, block_size=256, top_k=3, gate=gate) == 20 and len(lengths) == 3
    # sparse never faster up to 64K keys: twice the longest length tried
    monkeypatch.setattr(decode_kernels, "step_times", lambda q, hkv, n, **kw: (2.0, 1.0))
    assert decode_kernels.decode_crossover(q, k, block_size=4096, top_k=3, gate=gate) == 2 * 10


def test_only_decode_steps_measure_the_crossover(monkeypatch):
    from moba_hf.kernels import decode as decode_kernels

    monkeypatch.delenv("MOBA_HF_DECODE_CROSSOVER")
    monkeypatch.setattr(decode_kernels, "_crossovers", {})
    measured = []
    monkeypatch.setattr(decode_kernels, "_measure_crossover", lambda *a: measured.append(1) or 1)
    model = tiny_model("llama", MobaConfig(block_size=4, top_k=2, decode="moba"))
    ids = torch.randint(0, 97, (1, 30))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :20], **{CACHE: cache}, use_cache=True)  # a cached prefill
        model(ids[:, 20:29], **{CACHE: cache}, use_cache=True)  # a chunk past DECODE_MAX_QUERIES
        assert measured == []
        model(ids[:, 29:], **{CACHE: cache}, use_cache=True)  # a decode step: measured once for all layers
    assert measured == [1]


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_crossover_override_is_refused(value, monkeypatch):
    from moba_hf.kernels.decode import decode_crossover

    monkeypatch.setenv("MOBA_HF_DECODE_CROSSOVER", value)
    with pytest.raises(
        ValueError, match=f"MOBA_HF_DECODE_CROSSOVER must be a whole number of blocks >= 0, got '{value}'"
    ):
        decode_crossover(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 4, 4), block_size=2, top_k=1, gate=GateOptions())


@pytest.mark.parametrize("decode", ["moba", "full"])
def test_chunked_prefill_equals_one_prefill(decode, monkeypatch):
    moba = MobaConfig(block_size=4, top_k=3, decode=decode)
    model = tiny_model("llama", moba)
    spy = Spy(monkeypatch)
    ids = torch.randint(0, 97, (2, 45))
    with torch.no_grad():
        want = model(ids).logits
        cache = DynamicCache(config=model.config)
        got, t = [], 0
        # <= 8 new tokens: the decode kernel; more: the prefill kernel. (decode="full" makes 1-token steps dense.)
        chunks = (9, 3, 12, 1, 2, 11, 1, 6) if decode == "moba" else (9, 3, 12, 2, 2, 11, 6)
        for chunk in chunks:
            got.append(model(ids[:, t : t + chunk], **{CACHE: cache}, use_cache=True).logits)
            t += chunk
    assert t == ids.shape[1]
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=MODEL_TOL, atol=MODEL_TOL)
    if decode == "moba":
        assert spy.decodes == 5 * 2 and spy.builds == 2  # state kept in step through the long chunks


def test_state_is_rebuilt_after_reset_and_crop(monkeypatch):
    model = tiny_model("llama", MobaConfig(block_size=4, top_k=2))
    spy = Spy(monkeypatch)
    ids = torch.randint(0, 97, (1, 30))
    with torch.no_grad():
        want = model(ids).logits
        cache = DynamicCache(config=model.config)
        model(torch.randint(0, 97, (1, 17)), **{CACHE: cache}, use_cache=True)
        model(torch.randint(0, 97, (1, 1)), **{CACHE: cache}, use_cache=True)
        cache.reset()  # same cache object, new conversation
        model(ids[:, :20], **{CACHE: cache}, use_cache=True)
        cache.crop(-8)  # back to 12 tokens, e.g. rejected speculative tokens
        got = [model(ids[:, 12:13], **{CACHE: cache}, use_cache=True).logits]
        for t in range(13, 30):
            got.append(model(ids[:, t : t + 1], **{CACHE: cache}, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(got, dim=1), want[:, 12:], rtol=MODEL_TOL, atol=MODEL_TOL)
    assert spy.builds == 2 * 2  # first decode step, then once after reset + crop


def test_generate_uses_sparse_decode_and_matches_stepwise_argmax(monkeypatch):
    model = tiny_model("qwen2", MobaConfig(block_size=4, top_k=2))
    spy = Spy(monkeypatch)
    ids = torch.randint(0, 97, (1, 13))
    out = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert spy.decodes == 11 * 2 and spy.builds == 2
    with torch.no_grad():  # greedy: every generated token is the argmax of a full forward over its prefix
        logits = model(out[:, :-1]).logits
    assert torch.equal(logits[:, 12:].argmax(-1), out[:, 13:])


def test_sparse_decode_is_tracked():
    model = tiny_model("llama", MobaConfig(block_size=4, top_k=2))
    ids = torch.randint(0, 97, (1, 41))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :40], **{CACHE: cache}, use_cache=True)
        model(ids[:, 40:41], **{CACHE: cache}, use_cache=True)  # installs the hooks' view of this cache
        with moba_hf.track_sparsity() as stats:
            model(torch.randint(0, 97, (1, 1)), **{CACHE: cache}, use_cache=True)
    # the query at position 41 (block 10) reads its own 2 keys and one full earlier block
    assert stats.backends == {0: "decode", 1: "decode"}
    for sparsity in stats.per_layer().values():
        assert sparsity == pytest.approx(1 - 6 / 42)


def test_static_cache_refused():
    from transformers import StaticCache

    model = tiny_model("llama", MobaConfig(block_size=4, top_k=2))
    cache = StaticCache(config=model.config, max_cache_len=32)
    with pytest.raises(ValueError, match="StaticCache"), torch.no_grad():
        for _ in range(2):
            model(torch.randint(0, 97, (1, 4)), **{CACHE: cache}, use_cache=True)


@pytest.mark.cuda
def test_decode_kernel_on_cuda_matches_reference():
    dev = torch.device("cuda")
    q = torch.randn(2, 9, 1, 64, device=dev)
    keys, values = torch.randn(2, 3, 3000, 64, device=dev), torch.randn(2, 3, 3000, 64, device=dev)
    starts = torch.tensor([0, 517], device=dev)
    out = moba_decode(
        q, keys, values, block_keys_from_cache(keys, 256, "mean", starts), block_size=256, top_k=3, starts=starts
    )
    for r in range(2):
        s = int(starts[r])
        want = moba_attention_reference(
            q[r : r + 1], keys[r : r + 1, :, s:], values[r : r + 1, :, s:], block_size=256, top_k=3
        )
        tol = rounding_tol(torch.float32, 1, 3000, 64)
        torch.testing.assert_close(out[r : r + 1], want, rtol=tol, atol=tol)


def test_mask_function_accepts_cache_position_style_calls():
    # older transformers call the mask interface with cache_position instead of q_length / q_offset
    mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    assert moba_mask(batch_size=1, cache_position=torch.arange(5, 6), kv_length=6, attention_mask=mask).tolist() == [
        [False, True, True, True, True, True]
    ]
    assert moba_mask(batch_size=1, cache_position=torch.arange(5, 6), kv_length=6) is None
    with pytest.raises(ValueError, match="StaticCache"):
        moba_mask(batch_size=1, cache_position=torch.arange(5, 6), kv_length=32)  # a pre-allocated cache
