"""Paged MoBA and DCA without an engine: over vLLM's CPU cache layout, written by vLLM's own cache op, against
the kernels per sequence; the startup check of that layout."""

from __future__ import annotations

from pathlib import Path

import paged_cases
import pytest
import torch
from paged_cases import HKV, HQ, PAGE, QUERY_LENS, SEQ_LENS, C, D, S
from vllm import _custom_ops as ops

from moba_hf import MobaConfig, core
from moba_hf.dca.config import DcaParams
from moba_hf.kernels import attend_plan
from moba_hf.kernels.pooling import pooled_keys
from moba_hf.kernels.rope import default_inv_freq, rotate
from moba_hf.serving import ServedDca
from moba_hf.vllm import layouts, startup
from moba_hf.vllm.paged import PagedGateKeys, dense_decodes, moba_paged

ROOT = Path(__file__).resolve().parents[1]


def write_cpu(kv_cache, k, v, slots):
    """vLLM's CPU cache op, its 'vec' layout."""
    k_view, v_view = kv_cache.view(kv_cache.shape[0], HKV, PAGE * 2, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, k_view, v_view, slots, "vec")


def paged_batch(seq_lens, query_lens, seed=0):
    """Random K/V of several sequences written through vLLM's own cache op into shuffled pages."""
    return paged_cases.paged_batch(seq_lens, query_lens, lambda n: torch.zeros(n, HKV, PAGE, 2 * D), write_cpu, seed)


@pytest.mark.parametrize("config", list(paged_cases.CONFIGS))
@pytest.mark.parametrize("pooled_beside_pages", [False, True], ids=["gathered", "pooled-beside-pages"])
def test_mixed_batch_equals_moba_attention_per_sequence(config, pooled_beside_pages):
    batch = paged_batch(SEQ_LENS, QUERY_LENS)
    paged_cases.check_mixed_batch(
        paged_cases.CONFIGS[config], batch, layouts.cpu_layout, pooled_beside_pages=pooled_beside_pages
    )


def test_skip_decodes_leaves_decode_rows_to_the_caller():
    kv_cache, table, starts, _, _, query, key, value = paged_batch(SEQ_LENS, QUERY_LENS)
    key_cache, value_cache = layouts.cpu_layout(kv_cache)
    output = torch.full_like(query, float("nan"))
    moba_paged(
        query, key, value, key_cache, value_cache, output, query_start_loc=starts, seq_lens=SEQ_LENS,
        block_table=table, plan=core.plan_for(MobaConfig(block_size=64, top_k=2, decode="full"), 2), scale=D**-0.5,
        skip=dense_decodes(QUERY_LENS, core.plan_for(MobaConfig(decode="full"), 2)),
    )  # fmt: skip
    for i, nq in enumerate(QUERY_LENS):
        rows = output[starts[i] : starts[i + 1]]
        assert bool(rows.isnan().all()) == (nq == 1)


def test_dense_decodes_follow_the_mode_alone():
    # decode = "moba" is sparse at every sequence length (1, 3 and 6 blocks here): the config fixes the math
    query_lens = [1, 1, 5, 1]
    assert dense_decodes(query_lens, core.plan_for(MobaConfig(block_size=256, decode="full"), 2)) == [0, 1, 3]
    assert dense_decodes(query_lens, core.plan_for(MobaConfig(block_size=256, decode="moba"), 2)) == []


def write_in_steps(kv_cache, pages, keys, values, steps, gate_keys):
    """Write a sequence's tokens through vLLM's cache op in consecutive pieces of the given sizes (a prompt, its
    chunks, decode steps), updating the pooled keys after each write as the backend does."""
    k_view, v_view = kv_cache.view(kv_cache.shape[0], HKV, PAGE * 2, D).chunk(2, dim=2)
    slots = pages.repeat_interleave(PAGE)[: keys.shape[0]] * PAGE + torch.arange(keys.shape[0]) % PAGE
    done = 0
    for n in steps:
        part = slice(done, done + n)
        ops.cpu_attn_reshape_and_cache(keys[part], values[part], k_view, v_view, slots[part], "vec")
        gate_keys.update(layouts.cpu_layout(kv_cache)[0], torch.unique(slots[part] // PAGE))
        done += n


def decode_step(config, kv_cache, pages, keys, values, query, gate_keys):
    """The plugin's sparse decode step of one sequence (its last key is the query's) and `moba_attention`'s answer."""
    length = keys.shape[0]
    output = torch.full_like(query, float("nan"))
    key_cache, value_cache = layouts.cpu_layout(kv_cache)
    moba_paged(
        query, keys[-1:], values[-1:], key_cache, value_cache, output, query_start_loc=[0, 1], seq_lens=[length],
        block_table=pages[None].int(), plan=core.plan_for(config, 2), scale=D**-0.5, gate_keys=gate_keys,
    )  # fmt: skip
    want = attend_plan(
        query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], config.plan(1), D**-0.5
    )
    return output.transpose(0, 1)[None], want


@pytest.mark.parametrize(
    "config",
    [
        MobaConfig(block_size=64, top_k=2),  # two pages a block
        MobaConfig(block_size=48, top_k=3, pooling="bound", sink_blocks=1, local_blocks=1),  # units of 16
        MobaConfig(block_size=20, top_k=2, pooling="mean+max"),  # units of 4, blocks across pages
        MobaConfig(block_size=16, top_k=1, pooling="max"),  # two blocks a page, own block only
        MobaConfig(block_size=32, top_k=50),  # every block
    ],
    ids=["blk64-k2", "blk48-k3-bound-sink1-local1", "blk20-k2-meanmax", "blk16-k1-max", "blk32-all"],
)
@pytest.mark.parametrize("length", [1, 33, 64, 65, 130, 257])
def test_sparse_decode_over_pooled_keys_equals_moba_attention(config, length):
    gen = torch.Generator().manual_seed(length)
    n_pages = -(-length // PAGE)
    kv_cache = torch.randn(n_pages + 4, HKV, PAGE, 2 * D, generator=gen)  # pages hold an earlier sequence's data
    pages = torch.randperm(n_pages + 4, generator=gen)[:n_pages]
    keys, values = torch.randn(length, HKV, D, generator=gen), torch.randn(length, HKV, D, generator=gen)
    gate_keys = PagedGateKeys(layouts.cpu_layout(kv_cache)[0], config.block_size, config.pooling)
    gate_keys.stats.normal_(generator=gen)  # summaries of the earlier data, stale until the pages are rewritten
    prompt = max(length - 5, 1)
    write_in_steps(kv_cache, pages, keys, values, [prompt] + [1] * (length - prompt), gate_keys)
    query = torch.randn(1, HQ, D, generator=gen)
    got, want = decode_step(config, kv_cache, pages, keys, values, query, gate_keys)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pooled_keys_beside_the_pages_equal_pooled_keys():
    for pooling in ("mean", "max", "mean+max", "bound"):
        for block in (16, 20, 48, 64, 96):
            gen = torch.Generator().manual_seed(block)
            length = 5 * block + 7
            n_pages = -(-length // PAGE)
            kv_cache = torch.randn(n_pages + 2, HKV, PAGE, 2 * D, generator=gen)
            pages = torch.randperm(n_pages + 2, generator=gen)[:n_pages]
            keys, values = torch.randn(length, HKV, D, generator=gen), torch.randn(length, HKV, D, generator=gen)
            gate_keys = PagedGateKeys(layouts.cpu_layout(kv_cache)[0], block, pooling)
            write_in_steps(kv_cache, pages, keys, values, [block + 3, 2 * block - 1] + [1] * (2 * block + 5), gate_keys)
            got = gate_keys.block_keys(pages, length)
            want = pooled_keys(keys.transpose(0, 1)[None], block, pooling)
            assert got.shape == want.shape
            torch.testing.assert_close(got[:, :, :-1], want[:, :, :-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_sparse_decode_propagates_nan_and_inf_as_moba_attention(bad):
    config = MobaConfig(block_size=32, top_k=2)
    gen = torch.Generator().manual_seed(3)
    length = 150
    kv_cache = torch.zeros(5, HKV, PAGE, 2 * D)
    pages = torch.arange(5)
    keys, values = torch.randn(length, HKV, D, generator=gen), torch.randn(length, HKV, D, generator=gen)
    keys[40, 1, 3] = float(bad)  # a key in block 1 of KV head 1
    values[70, 0, 5] = float(bad)  # a value in block 2 of KV head 0
    gate_keys = PagedGateKeys(layouts.cpu_layout(kv_cache)[0], config.block_size, config.pooling)
    write_in_steps(kv_cache, pages, keys, values, [length], gate_keys)
    query = torch.randn(1, HQ, D, generator=gen)
    got, want = decode_step(config, kv_cache, pages, keys, values, query, gate_keys)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("case", list(paged_cases.DCA_CONFIGS))
def test_paged_dca_mixed_batch_equals_dca_per_sequence(case):
    paged_cases.check_dca_mixed_batch(case, lambda n: torch.zeros(n, HKV, PAGE, 2 * D), write_cpu, layouts.cpu_layout)


def test_dca_deltas_follow_the_sequence_positions():
    dca = ServedDca(DcaParams(pretraining_length=C, chunk_size=S), default_inv_freq(D, 1e4))
    starts = [0, 3, 4, 6]
    delta = dca.deltas(starts, [3, 100, 50])  # a prompt, a decode at position 99, two tokens at 48 and 49
    assert delta.tolist() == [0, 0, 0, 99 % S - 99, -48, -48]
    key = torch.randn(8, HKV, D)  # two rows of padding past the batch's tokens stay as they are
    moved = dca.move(key, delta)
    assert torch.equal(moved[6:], key[6:]) and torch.equal(moved[:3], key[:3])
    torch.testing.assert_close(moved[4:6], rotate(key[4:6], torch.tensor([[-48], [-48]]), dca.inv_freq))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_cache_layout_check_reads_vllm_layout(isa, dtype, monkeypatch):
    layouts.check_cpu_layout(isa, dtype, 128, 64)  # vLLM's own op writes a layout the plugin reads back
    # the check compares what it reads with what vLLM wrote: a reader with the page's positions reversed is refused
    real = layouts.cpu_layout
    monkeypatch.setattr(layouts, "cpu_layout", lambda kv_cache: (real(kv_cache)[0].flip(-1), real(kv_cache)[1]))
    with pytest.raises(startup.MobaSetupError, match=f"layout for isa={isa!r}"):
        layouts.check_cpu_layout(isa, dtype, 128, 64)


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="needs a CPU with AMX")
def test_cache_layout_check_refuses_amx_layout():
    with pytest.raises(startup.MobaSetupError, match="layout for isa='amx'"):
        layouts.check_cpu_layout("amx", torch.bfloat16, 128, 64)
