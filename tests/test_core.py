"""The one attention core: which route a sequence takes, and both hosts (transformers' attention function and the
vLLM plugin's paged attention) reaching the same core functions with the same routes."""

import pytest
import torch
from tiny_models import tiny_model

from moba_hf import MobaConfig, core
from moba_hf.dca.config import DcaParams
from moba_hf.kernels.pooling import BlockStats, pooled_keys
from moba_hf.kernels.rope import default_inv_freq
from moba_hf.vllm.layouts import flash_layout
from moba_hf.vllm.paged import PagedGateKeys, moba_paged

DCA = core.Dca(DcaParams(pretraining_length=96, chunk_size=64), default_inv_freq(8, 10000.0))


@pytest.mark.parametrize(
    "config, nq, nk, dense_layer, dca, route",
    [
        (MobaConfig(), 5, 9, False, None, "moba"),
        (MobaConfig(), 5, 9, True, None, "sdpa"),
        (MobaConfig(sparse=False), 5, 9, False, None, "sdpa"),
        (MobaConfig(decode="full"), 1, 9, False, None, "sdpa"),
        (MobaConfig(decode="full"), 2, 9, False, None, "moba"),
        (MobaConfig(decode="moba"), 1, 9, False, None, "moba"),
        (MobaConfig(), 5, 64, False, DCA, "moba"),  # one chunk: DCA changes nothing
        (MobaConfig(), 5, 65, False, DCA, "dca+moba"),
        (MobaConfig(), 5, 65, True, DCA, "dca"),
        (MobaConfig(decode="full"), 1, 65, False, DCA, "dca"),
    ],
)
def test_route(config, nq, nk, dense_layer, dca, route):
    assert core.route(core.runs_dense(core.plan_for(config, 2), nq, dense_layer), nk, dca) == route


def spy(monkeypatch):
    """Record (function, route) for every call of core.attend / core.decode, which still run."""
    calls = []
    attend, decode = core.attend, core.decode

    def attend_spy(q, k, v, plan, scale, route, dca=None):
        calls.append(("attend", route))
        return attend(q, k, v, plan, scale, route, dca)

    def decode_spy(*args, **kwargs):
        calls.append(("decode", "moba"))
        return decode(*args, **kwargs)

    monkeypatch.setattr(core, "attend", attend_spy)
    monkeypatch.setattr(core, "decode", decode_spy)
    return calls


CONFIG = MobaConfig(block_size=8, top_k=2, full_attn_layers=1, decode="moba")
PLAN = core.plan_for(CONFIG, 2)


def test_transformers_reaches_the_core(monkeypatch):
    model = tiny_model("llama", CONFIG, layers=2)
    calls = spy(monkeypatch)
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        assert calls == [("attend", "moba"), ("attend", "sdpa")]  # layer 1 is the dense last layer
        calls.clear()
        model(ids[:, -1:] * 0 + 5, past_key_values=out.past_key_values, use_cache=True)
    assert calls == [("decode", "moba"), ("attend", "sdpa")]


def test_transformers_asks_runs_dense_once_per_call(monkeypatch):
    """The attention function decides dense or sparse once per layer call; `core.route` takes that answer."""
    model = tiny_model("llama", CONFIG, layers=2)
    asked, runs_dense = [], core.runs_dense
    monkeypatch.setattr(core, "runs_dense", lambda *args: asked.append(args) or runs_dense(*args))
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(0)))
    assert len(asked) == 2  # one call per layer


def flash_paged(seq_lens, hkv=2, d=8, page=16, seed=0):
    """Keys and values of several sequences in shuffled pages of vLLM's GPU layout (num_pages, 2, page, Hkv, D)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // page) for n in seq_lens]
    order = torch.randperm(sum(per_seq) + 2, generator=gen)
    kv_cache = torch.full((sum(per_seq) + 2, 2, page, hkv, d), float("nan"))
    table = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32)
    keys, values, used = [], [], 0
    for i, n in enumerate(seq_lens):
        pages = order[used : used + per_seq[i]]
        used += per_seq[i]
        table[i, : len(pages)] = pages.int()
        k, v = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
        slots = pages.repeat_interleave(page)[:n] * page + torch.arange(n) % page
        kv_cache[slots // page, 0, slots % page] = k
        kv_cache[slots // page, 1, slots % page] = v
        keys.append(k), values.append(v)
    return kv_cache, table, keys, values


def test_vllm_paged_attention_reaches_the_core_and_matches_it(monkeypatch):
    seq_lens, query_lens, hq = [40, 57, 33], [40, 1, 9], 4  # a prompt, a decode step, a chunk after a prefix
    kv_cache, table, keys, values = flash_paged(seq_lens)
    key_cache, value_cache = flash_layout(kv_cache)
    gate_keys = PagedGateKeys(key_cache, CONFIG.block_size, CONFIG.pooling)
    gate_keys.update(key_cache, torch.arange(kv_cache.shape[0]))
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(sum(query_lens), hq, 8, generator=gen)
    starts = [0, 40, 41, 50]
    new_k = torch.cat([k[-nq:] for k, nq in zip(keys, query_lens, strict=True)])
    new_v = torch.cat([v[-nq:] for v, nq in zip(values, query_lens, strict=True)])
    output = torch.full_like(query, float("nan"))
    calls = spy(monkeypatch)
    moba_paged(
        query, new_k, new_v, key_cache, value_cache, output, query_start_loc=starts, seq_lens=seq_lens,
        block_table=table, plan=PLAN, scale=None, gate_keys=gate_keys,
    )  # fmt: skip
    assert calls == [("attend", "moba"), ("decode", "moba"), ("attend", "moba")]
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        q = query[starts[i] : starts[i + 1]].transpose(0, 1)[None]
        expected = core.attend(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], PLAN, None, "moba")
        got = output[starts[i] : starts[i + 1]].transpose(0, 1)[None]
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("pooling", ["mean", "max", "mean+max", "bound"])
def test_block_stats_give_pooled_keys_however_the_keys_are_cut(pooling):
    """Statistics merged from units, from single keys and from whole blocks give `pooled_keys`' pooled key."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 24, 5, dtype=torch.float64, generator=gen)
    pool = BlockStats.of(pooling, 5)
    expected = pooled_keys(k, 8, pooling)
    counts = torch.full((3,), 8.0, dtype=torch.float64)
    units = pool.reduce_blocks(k, 4).unflatten(2, (3, 2))  # two units of 4 keys per block
    torch.testing.assert_close(pool.pooled(pool.merge(units, 3), counts), expected, rtol=0, atol=1e-14)
    running = pool.empty(2, 3, 3, dtype=torch.float64, device="cpu")
    for j in range(24):
        pool.merge_(running[:, :, j // 8], pool.of_keys(k[:, :, j]))
    torch.testing.assert_close(pool.pooled(running, counts), expected, rtol=0, atol=1e-14)
    scattered = pool.scattered(pool.empty(2, 3, 3, dtype=torch.float64, device="cpu"), 2, torch.arange(24) // 8, k)
    torch.testing.assert_close(pool.pooled(scattered, counts), expected, rtol=0, atol=1e-14)
    # one count for every block (as int) == the same count per block (as tensor), bit for bit
    assert torch.equal(pool.pooled(scattered, 8), pool.pooled(scattered, counts))
    # an empty block pools to zeros, whichever way its count is given
    for none in (torch.zeros(1), 0):
        empty = pool.pooled(pool.empty(1, 1, 1, dtype=torch.float64, device="cpu"), none)
        assert torch.equal(empty, torch.zeros_like(empty))
