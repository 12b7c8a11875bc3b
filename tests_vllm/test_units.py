"""The plugin's pieces without an engine: paged MoBA over vLLM's CPU cache layout, the startup refusals."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import MAX_MODEL_LEN, model_path
from vllm import _custom_ops as ops

from moba_hf import MobaConfig, causal_attention, moba_attention
from moba_hf.dca.config import DcaParams
from moba_hf.kernels.common import pooled_keys
from moba_hf.kernels.dca import dca_attention
from moba_hf.kernels.rope import default_inv_freq, rotate
from moba_hf.vllm import backend, settings
from moba_hf.vllm.paged import PagedDca, PagedGateKeys, dense_decodes, moba_paged

ROOT = Path(__file__).resolve().parents[1]
PAGE, HQ, HKV, D = 32, 6, 2, 64


def paged_batch(seq_lens, query_lens, seed=0):
    """Random K/V of several sequences written through vLLM's own cache op into shuffled pages."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // PAGE) for n in seq_lens]
    order = torch.randperm(sum(pages_per_seq) + 3, generator=gen)[: sum(pages_per_seq)]
    kv_cache = torch.zeros(sum(pages_per_seq) + 3, HKV, PAGE, 2 * D)
    k_view, v_view = kv_cache.view(kv_cache.shape[0], HKV, PAGE * 2, D).chunk(2, dim=2)
    block_table = torch.zeros(len(seq_lens), max(pages_per_seq), dtype=torch.int32)
    keys, values, queries, new_k, new_v = [], [], [], [], []
    used = 0
    for i, (n, nq) in enumerate(zip(seq_lens, query_lens, strict=True)):
        pages = order[used : used + pages_per_seq[i]]
        used += pages_per_seq[i]
        block_table[i, : len(pages)] = pages.int()
        k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
        slots = pages.repeat_interleave(PAGE)[:n] * PAGE + torch.arange(n) % PAGE
        ops.cpu_attn_reshape_and_cache(k, v, k_view, v_view, slots, "vec")
        keys.append(k), values.append(v), new_k.append(k[n - nq :]), new_v.append(v[n - nq :])
        queries.append(torch.randn(nq, HQ, D, generator=gen))
    starts = [0]
    for nq in query_lens:
        starts.append(starts[-1] + nq)
    return kv_cache, block_table, starts, keys, values, torch.cat(queries), torch.cat(new_k), torch.cat(new_v)


# a fresh prompt, a decode step, a chunk starting inside a MoBA block (110 = 64 + 46), a prompt after a cached
# prefix of 96 tokens (three pages, one and a half MoBA blocks), a one-token prompt, a decode step over 300
SEQ_LENS = [70, 75, 150, 200, 1, 300]
QUERY_LENS = [70, 1, 40, 104, 1, 1]


@pytest.mark.parametrize(
    "config",
    [
        MobaConfig(block_size=64, top_k=2),
        MobaConfig(block_size=48, top_k=3, pooling="bound", sink_blocks=1, local_blocks=1),
        MobaConfig(block_size=20, top_k=2, decode="full", pooling="mean+max"),
        MobaConfig(block_size=48, top_k=2, pooling="bound", dense_tail=30),
    ],
    ids=["blk64-k2", "blk48-k3-bound-sink1-local1", "blk20-k2-decodefull", "blk48-k2-bound-tail30"],
)
@pytest.mark.parametrize("pooled_beside_pages", [False, True], ids=["gathered", "pooled-beside-pages"])
def test_mixed_batch_equals_moba_attention_per_sequence(config, pooled_beside_pages):
    kv_cache, table, starts, keys, values, query, key, value = paged_batch(SEQ_LENS, QUERY_LENS)
    key_cache, value_cache = backend.cache_views(kv_cache)
    gate_keys = None
    if pooled_beside_pages:  # decode = "moba" steps read only their selected blocks
        gate_keys = PagedGateKeys(key_cache, config.block_size, config.pooling)
        gate_keys.update(key_cache, torch.arange(kv_cache.shape[0]))
    output = torch.full_like(query, float("nan"))
    scale = D**-0.5
    moba_paged(
        query, key, value, key_cache, value_cache, output, query_start_loc=starts, seq_lens=SEQ_LENS,
        block_table=table, config=config, scale=scale, gate_keys=gate_keys,
    )  # fmt: skip
    gate = dict(pooling=config.pooling, sink_blocks=config.sink_blocks, local_blocks=config.local_blocks)
    for i, nq in enumerate(QUERY_LENS):
        q = query[starts[i] : starts[i + 1]].transpose(0, 1)[None]
        k, v = keys[i].transpose(0, 1)[None], values[i].transpose(0, 1)[None]
        if nq == 1 and config.decode == "full":
            want = causal_attention(q, k, v, scale=scale)
        else:
            want = moba_attention(q, k, v, block_size=config.block_size, top_k=config.top_k, scale=scale, **gate)
            tail = min(config.dense_tail, nq) if nq > 1 else 0  # a prompt's or a chunk's last queries, not a decode
            if tail:
                want[:, :, nq - tail :] = causal_attention(q[:, :, nq - tail :], k, v, scale=scale)
        got = output[starts[i] : starts[i + 1]].transpose(0, 1)[None]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"sequence {i}")


def test_skip_decodes_leaves_decode_rows_to_the_caller():
    kv_cache, table, starts, _, _, query, key, value = paged_batch(SEQ_LENS, QUERY_LENS)
    key_cache, value_cache = backend.cache_views(kv_cache)
    output = torch.full_like(query, float("nan"))
    moba_paged(
        query, key, value, key_cache, value_cache, output, query_start_loc=starts, seq_lens=SEQ_LENS,
        block_table=table, config=MobaConfig(block_size=64, top_k=2, decode="full"), scale=D**-0.5,
        skip=dense_decodes(QUERY_LENS, MobaConfig(decode="full")),
    )  # fmt: skip
    for i, nq in enumerate(QUERY_LENS):
        rows = output[starts[i] : starts[i + 1]]
        assert bool(rows.isnan().all()) == (nq == 1)


def test_dense_decodes_follow_the_mode_alone():
    # decode = "moba" is sparse at every sequence length (1, 3 and 6 blocks here): the config fixes the math
    query_lens = [1, 1, 5, 1]
    assert dense_decodes(query_lens, MobaConfig(block_size=256, decode="full")) == [0, 1, 3]
    assert dense_decodes(query_lens, MobaConfig(block_size=256, decode="moba")) == []


def write_in_steps(kv_cache, pages, keys, values, steps, gate_keys):
    """Write a sequence's tokens through vLLM's cache op in consecutive pieces of the given sizes (a prompt, its
    chunks, decode steps), updating the pooled keys after each write as the backend does."""
    k_view, v_view = kv_cache.view(kv_cache.shape[0], HKV, PAGE * 2, D).chunk(2, dim=2)
    slots = pages.repeat_interleave(PAGE)[: keys.shape[0]] * PAGE + torch.arange(keys.shape[0]) % PAGE
    done = 0
    for n in steps:
        part = slice(done, done + n)
        ops.cpu_attn_reshape_and_cache(keys[part], values[part], k_view, v_view, slots[part], "vec")
        gate_keys.update(backend.cache_views(kv_cache)[0], torch.unique(slots[part] // PAGE))
        done += n


def decode_step(config, kv_cache, pages, keys, values, query, gate_keys):
    """The plugin's sparse decode step of one sequence (its last key is the query's) and `moba_attention`'s answer."""
    length = keys.shape[0]
    output = torch.full_like(query, float("nan"))
    key_cache, value_cache = backend.cache_views(kv_cache)
    moba_paged(
        query, keys[-1:], values[-1:], key_cache, value_cache, output, query_start_loc=[0, 1], seq_lens=[length],
        block_table=pages[None].int(), config=config, scale=D**-0.5, gate_keys=gate_keys,
    )  # fmt: skip
    want = moba_attention(
        query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        scale=D**-0.5, **config.kernel_kwargs(),
    )  # fmt: skip
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
    gate_keys = PagedGateKeys(backend.cache_views(kv_cache)[0], config.block_size, config.pooling)
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
            gate_keys = PagedGateKeys(backend.cache_views(kv_cache)[0], block, pooling)
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
    gate_keys = PagedGateKeys(backend.cache_views(kv_cache)[0], config.block_size, config.pooling)
    write_in_steps(kv_cache, pages, keys, values, [length], gate_keys)
    query = torch.randn(1, HQ, D, generator=gen)
    got, want = decode_step(config, kv_cache, pages, keys, values, query, gate_keys)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


# DCA with c = 64, s = 48 (MoBA blocks of 16 tile a chunk): a prompt over four chunks, a decode step, a chunk of
# 40 crossing a DCA chunk boundary (90 cached), a prompt after a cached prefix of 96, a one-token prompt, a prompt
# and a decode step inside the first chunk (plain attention there)
DCA_SEQ_LENS = [150, 175, 130, 200, 1, 30, 40]
DCA_QUERY_LENS = [150, 1, 40, 104, 1, 30, 1]
C, S = 64, 48


def dca_paged_batch(dca: PagedDca, seq_lens, query_lens):
    """A batch as vLLM hands it to the backend: q / k of the new tokens rotated at their index p (vLLM's RoPE),
    the cached keys at p mod s (written by earlier steps); the new keys go through `PagedDca.move` and vLLM's
    cache op, as `do_kv_cache_update` does. Also returns each sequence's raw (unrotated) q, k, v."""
    kv_cache, table, starts, raw_k, values, raw_q, _, new_v = paged_batch(seq_lens, query_lens, seed=1)
    k_view, v_view = kv_cache.view(kv_cache.shape[0], HKV, PAGE * 2, D).chunk(2, dim=2)
    queries, new_k = [], []
    for i, (n, nq) in enumerate(zip(seq_lens, query_lens, strict=True)):
        p = torch.arange(n)
        slots = table[i].long().repeat_interleave(PAGE)[:n] * PAGE + p % PAGE
        cached = rotate(raw_k[i][: n - nq], (p % S)[: n - nq, None], dca.inv_freq)
        ops.cpu_attn_reshape_and_cache(cached, values[i][: n - nq], k_view, v_view, slots[: n - nq], "vec")
        new_k.append(rotate(raw_k[i][n - nq :], p[n - nq :, None], dca.inv_freq))
        queries.append(rotate(raw_q[starts[i] : starts[i + 1]], p[n - nq :, None], dca.inv_freq))
    query, key = torch.cat(queries), torch.cat(new_k)
    delta = dca.deltas(starts, seq_lens)
    moved = dca.move(key, delta)
    slots = torch.cat([table[i].long().repeat_interleave(PAGE)[n - nq : n] * PAGE + torch.arange(n - nq, n) % PAGE
                       for i, (n, nq) in enumerate(zip(seq_lens, query_lens, strict=True))])  # fmt: skip
    ops.cpu_attn_reshape_and_cache(moved, new_v, k_view, v_view, slots, "vec")
    return kv_cache, table, starts, raw_q, raw_k, values, dca.move(query, delta), moved, new_v


@pytest.mark.parametrize(
    "config,temperature",
    [
        (MobaConfig(sparse=False), False),
        (MobaConfig(block_size=16, top_k=3), True),
        (MobaConfig(block_size=16, top_k=2, pooling="bound", sink_blocks=1, local_blocks=1, decode="full"), False),
        (MobaConfig(block_size=16, top_k=2, pooling="bound", dense_tail=5), True),
    ],
    ids=["dense", "blk16-k3-temperature", "blk16-k2-bound-sink1-local1-decodefull", "blk16-k2-bound-tail5"],
)
def test_paged_dca_mixed_batch_equals_dca_per_sequence(config, temperature):
    dca = PagedDca(DcaParams(pretraining_length=C, chunk_size=S, temperature=temperature), default_inv_freq(D, 1e4))
    kv_cache, table, starts, raw_q, raw_k, values, query, key, value = dca_paged_batch(
        dca, DCA_SEQ_LENS, DCA_QUERY_LENS
    )
    key_cache, value_cache = backend.cache_views(kv_cache)
    output = torch.full_like(query, float("nan"))
    scale = D**-0.5
    moba_paged(
        query, key, value, key_cache, value_cache, output, query_start_loc=starts, seq_lens=DCA_SEQ_LENS,
        block_table=table, config=config, scale=scale, dense=not config.sparse, dca=dca,
    )  # fmt: skip
    gate = dict(pooling=config.pooling, sink_blocks=config.sink_blocks, local_blocks=config.local_blocks)
    for i, (n, nq) in enumerate(zip(DCA_SEQ_LENS, DCA_QUERY_LENS, strict=True)):
        # the reference rotates the raw q / k straight to their DCA positions: i mod s, j mod s
        p = torch.arange(n)
        q = rotate(raw_q[starts[i] : starts[i + 1]], p[n - nq :, None] % S, dca.inv_freq).transpose(0, 1)[None]
        k = rotate(raw_k[i], p[:, None] % S, dca.inv_freq).transpose(0, 1)[None]
        v = values[i].transpose(0, 1)[None]
        dense = not config.sparse or (nq == 1 and config.decode == "full")
        moba = {} if dense else dict(block_size=config.block_size, top_k=config.top_k, **gate)
        dca_args = dict(pretraining_length=C, chunk_size=S, inv_freq=dca.inv_freq, scale=scale,
                        temperature=dca.params.temperature_factor(n))  # fmt: skip
        if n > S:
            want = dca_attention(q, k, v, **dca_args, **moba)
        elif dense:
            want = causal_attention(q, k, v, scale=scale)
        else:
            want = moba_attention(q, k, v, scale=scale, **moba)
        tail = min(config.dense_tail, nq) if nq > 1 and not dense else 0  # the last queries of a prompt or chunk
        if tail:  # attend as dense DCA (plain causal attention within one chunk) over all n keys
            dense_rows = dca_attention(q, k, v, **dca_args) if n > S else causal_attention(q, k, v, scale=scale)
            want[:, :, nq - tail :] = dense_rows[:, :, nq - tail :]
        got = output[starts[i] : starts[i + 1]].transpose(0, 1)[None]
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=f"sequence {i}")


def test_dca_deltas_follow_the_sequence_positions():
    dca = PagedDca(DcaParams(pretraining_length=C, chunk_size=S), default_inv_freq(D, 1e4))
    starts = [0, 3, 4, 6]
    delta = dca.deltas(starts, [3, 100, 50])  # a prompt, a decode at position 99, two tokens at 48 and 49
    assert delta.tolist() == [0, 0, 0, 99 % S - 99, -48, -48]
    key = torch.randn(8, HKV, D)  # two rows of padding past the batch's tokens stay as they are
    moved = dca.move(key, delta)
    assert torch.equal(moved[6:], key[6:]) and torch.equal(moved[:3], key[:3])
    torch.testing.assert_close(moved[4:6], rotate(key[4:6], torch.tensor([[-48], [-48]]), dca.inv_freq))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_cache_layout_check_reads_vllm_layout(isa, dtype):
    backend.check_cache_layout(isa, dtype, 128, 64)


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="needs a CPU with AMX")
def test_cache_layout_check_refuses_amx_layout():
    with pytest.raises(settings.MobaSetupError, match="layout for isa='amx'"):
        backend.check_cache_layout("amx", torch.bfloat16, 128, 64)


# --- configuration and refusals (the same function the engine runs when it builds its attention layers) ------
def vllm_config(model: str | None = None, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=model or model_path(), dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True)
    return EngineArgs(**{**args, **kwargs}).create_engine_config()


def test_no_moba_config_leaves_vllm_alone(monkeypatch):
    monkeypatch.delenv(settings.ENV, raising=False)
    assert backend._setup(vllm_config()) is None


def test_sources_and_precedence(monkeypatch):
    monkeypatch.setenv(settings.ENV, "training-free")
    config, dense, dca = backend._setup(vllm_config())
    preset = MobaConfig.preset("training-free")
    assert config == preset and dense == preset.full_layer_set(30) and dca is None
    config, dense, _ = backend._setup(vllm_config(hf_overrides={"moba_config": {"block_size": 256, "top_k": 2}}))
    assert config == MobaConfig(block_size=256, top_k=2) and dense == frozenset()


@pytest.mark.parametrize("name", ["long_doc", "chat", "code"])
def test_serving_configs(name, monkeypatch):
    monkeypatch.setenv(settings.ENV, str(ROOT / "configs" / f"serving_{name}.toml"))
    config, dense, _ = backend._setup(vllm_config())
    expected = {
        "long_doc": (MobaConfig(block_size=4096, top_k=4, full_attn_layers=2, decode="full"), {28, 29}),
        "chat": (MobaConfig(block_size=2048, top_k=3, decode="full"), set()),
        "code": (MobaConfig(block_size=8192, top_k=5, decode="full"), set()),
    }[name]
    assert (config, dense) == expected


def model_dir(tmp_path, **config):
    """A config-only checkpoint directory (the tokenizer of SmolLM2) for configuration checks."""
    import json
    import shutil

    source = Path(model_path())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    base = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    return str(tmp_path)


REFUSALS = {
    "bad-moba-config": (dict(hf_overrides={"moba_config": {"block_size": 0}}), "block_size must be an integer >= 1"),
    "unknown-key": (dict(hf_overrides={"moba_config": {"blok_size": 64}}), "unknown MoBA config keys"),
    "dense-layer-out-of-range": (
        dict(hf_overrides={"moba_config": {"full_attn_layer_ids": [30]}}),
        "outside the model's layers",
    ),
    "fp8-kv-cache": (dict(hf_overrides={"moba_config": {}}, kv_cache_dtype="fp8"), "not readable by the MoBA"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals(case, monkeypatch):
    monkeypatch.delenv(settings.ENV, raising=False)
    kwargs, message = REFUSALS[case]
    with pytest.raises(settings.MobaSetupError, match=message):
        backend._setup(vllm_config(**kwargs))


def test_refuses_unknown_preset(monkeypatch):
    monkeypatch.setenv(settings.ENV, "no-such-preset")
    with pytest.raises(settings.MobaSetupError, match="neither a preset"):
        backend._setup(vllm_config())


def test_refuses_server_file_limits(monkeypatch, tmp_path):
    path = tmp_path / "server.toml"
    path.write_text("block_size = 256\ntop_k = 3\nmax_context_tokens = 2048\n")
    monkeypatch.setenv(settings.ENV, str(path))
    with pytest.raises(settings.MobaSetupError, match="max_context_tokens=2048"):
        backend._setup(vllm_config())


@pytest.mark.parametrize("spelling", ["fp16", "float16", "half", "FP16"])
def test_server_file_kv_cache_dtype_spellings_match_vllm_flags(spelling, monkeypatch, tmp_path):
    path = tmp_path / "server.toml"
    path.write_text(f'[attention]\ntype = "moba"\nblock_size = 256\n[attention.kv_cache]\ndtype = "{spelling}"\n')
    monkeypatch.setenv(settings.ENV, str(path))
    assert backend._setup(vllm_config(dtype="float16")) is not None  # the KV cache follows --dtype (auto)
    assert backend._setup(vllm_config(dtype="half", kv_cache_dtype="float16")) is not None


def test_kv_cache_dtype_refusal_names_flags_vllm_accepts(monkeypatch, tmp_path):
    from typing import get_args

    from vllm.config.cache import CacheDType
    from vllm.config.model import ModelDType

    path = tmp_path / "server.json"
    path.write_text('{"block_size": 256, "kv_cache_dtype": "bf16"}')
    monkeypatch.setenv(settings.ENV, str(path))
    with pytest.raises(settings.MobaSetupError, match="asks for kv_cache_dtype='bfloat16'") as refused:
        backend._setup(vllm_config())  # float32 model, cache auto
    flags = dict(re.findall(r"(--dtype|--kv-cache-dtype) ([\w.]+)", str(refused.value).split("start vLLM with")[1]))
    assert flags["--dtype"] == "bfloat16" and flags["--dtype"] in get_args(ModelDType)
    assert flags["--kv-cache-dtype"] in get_args(CacheDType)
    assert backend._setup(vllm_config(dtype=flags["--dtype"], kv_cache_dtype=flags["--kv-cache-dtype"])) is not None


def test_refuses_unsupported_architecture(monkeypatch, tmp_path):
    monkeypatch.setenv(settings.ENV, "training-free")
    path = model_dir(tmp_path, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    message = "supports LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM; this checkpoint is MistralForCausalLM"
    with pytest.raises(settings.MobaSetupError, match=message):
        backend._setup(vllm_config(path))


def test_refuses_max_model_len_past_the_rope_table(monkeypatch, tmp_path):
    monkeypatch.delenv(settings.ENV, raising=False)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own length check comes first otherwise
    path = model_dir(tmp_path, max_position_embeddings=2048)
    message = "max_model_len=4096 needs RoPE positions up to 4095, but vLLM's RoPE table covers max_position_embeddings"
    with pytest.raises(settings.MobaSetupError, match=re.escape(message)):
        backend._setup(vllm_config(path, hf_overrides={"moba_config": {"block_size": 128}}))
    # raising the table through --hf-overrides is accepted
    raised = {"moba_config": {"block_size": 128}, "max_position_embeddings": 4096}
    assert backend._setup(vllm_config(path, hf_overrides=raised)) is not None


def test_refuses_sliding_window(monkeypatch, tmp_path):
    monkeypatch.setenv(settings.ENV, "training-free")
    path = model_dir(
        tmp_path, model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
        sliding_window=1024, max_window_layers=0,
    )  # fmt: skip
    with pytest.raises(settings.MobaSetupError, match="sliding"):
        backend._setup(vllm_config(path))


# --- Dual Chunk Attention: where the engine finds it, and what it refuses ------------------------------------------
QWEN_DCA = {"chunk_size": 1023, "local_size": 127}  # c = 1024, s = 896 (the transformers path's mapping)
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 100000.0, "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 4096,
}  # fmt: skip


def qwen_dir(tmp_path, **config):
    return model_dir(
        tmp_path, model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
        sliding_window=None, **config,
    )  # fmt: skip


def test_dca_from_the_moba_config(monkeypatch):
    from transformers import AutoConfig

    monkeypatch.delenv(settings.ENV, raising=False)
    moba = {"sparse": False, "dca": {"pretraining_length": 1024, "temperature": True}}
    setup = backend._setup(vllm_config(hf_overrides={"moba_config": moba}))
    assert setup.dca.params == DcaParams(pretraining_length=1024, chunk_size=896, temperature=True)
    model = AutoConfig.from_pretrained(model_path())
    head_dim = model.hidden_size // model.num_attention_heads
    want = 1.0 / model.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
    torch.testing.assert_close(setup.dca.inv_freq, want)
    moba = {"block_size": 128, "top_k": 2, "dca": {"pretraining_length": 1024}}
    assert backend._setup(vllm_config(hf_overrides={"moba_config": moba})).dca.params.chunk_size == 896


def test_qwen_dual_chunk_attention_config_turns_dense_dca_on(monkeypatch, tmp_path):
    monkeypatch.delenv(settings.ENV, raising=False)
    path = qwen_dir(tmp_path, dual_chunk_attention_config=QWEN_DCA)
    config, dense, dca = backend._setup(vllm_config(path))
    assert config == MobaConfig(sparse=False) and dca.params == DcaParams(pretraining_length=1024, chunk_size=896)
    off = backend._setup(vllm_config(path, hf_overrides={"moba_config": {"block_size": 128, "dca": False}}))
    assert off.dca is None and off.config.sparse


def test_dca_accepts_llama3_rope(monkeypatch, tmp_path):
    monkeypatch.delenv(settings.ENV, raising=False)
    path = model_dir(tmp_path, rope_scaling=LLAMA3_ROPE)
    moba = {"sparse": False, "dca": {"pretraining_length": 1024}}
    assert backend._setup(vllm_config(path, hf_overrides={"moba_config": moba})).dca is not None


def test_dca_past_the_window_with_a_raised_rope_table(monkeypatch):
    # SmolLM2 (8K window) at 16K: vLLM's RoPE table raised to 16K, DCA's c set explicitly
    monkeypatch.delenv(settings.ENV, raising=False)
    moba = {"sparse": False, "dca": {"pretraining_length": 4096, "temperature": True}}
    overrides = {"max_position_embeddings": 16384, "moba_config": moba}
    setup = backend._setup(vllm_config(hf_overrides=overrides, max_model_len=16384))
    assert setup.dca.params == DcaParams(pretraining_length=4096, chunk_size=3584, temperature=True)


DENSE_DCA = {"moba_config": {"sparse": False, "dca": True}}
DCA_REFUSALS = {
    "rope-yarn": (
        dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096}),
        dict(hf_overrides=DENSE_DCA),
        "supports the rope types default, llama3; this model's is 'yarn'",
    ),
    "rope-linear": (
        dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
        dict(hf_overrides=DENSE_DCA),
        "this model's is 'linear'",
    ),
    "chunk-not-block-multiple": (
        {},
        dict(hf_overrides={"moba_config": {"block_size": 128, "dca": {"pretraining_length": 1024, "chunk_size": 900}}}),
        "chunk_size=900 must be a multiple of the MoBA block_size=128",
    ),
    "window-not-block-multiple": (
        {},
        dict(
            hf_overrides={"moba_config": {"block_size": 128, "dca": {"pretraining_length": 1024, "local_window": 100}}}
        ),
        "chunk_size=924 must be a multiple of the MoBA block_size=128",
    ),
    "max-model-len-past-rope-table": (
        dict(max_position_embeddings=2048),
        dict(hf_overrides=DENSE_DCA),
        "max_model_len=4096 needs RoPE positions up to 4095, but vLLM's RoPE table covers max_position_embeddings=2048",
    ),
    "raised-table-moves-c": (
        {},
        dict(hf_overrides={**DENSE_DCA, "max_position_embeddings": 16384}, max_model_len=16384),
        "follows max_position_embeddings, which --hf-overrides raises to 16384; set pretraining_length",
    ),
}


@pytest.mark.parametrize("case", list(DCA_REFUSALS))
def test_dca_refusals(case, monkeypatch, tmp_path):
    monkeypatch.delenv(settings.ENV, raising=False)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own length check comes first otherwise
    checkpoint, kwargs, message = DCA_REFUSALS[case]
    path = model_dir(tmp_path, **checkpoint) if checkpoint else None
    with pytest.raises(settings.MobaSetupError, match=re.escape(message)):
        backend._setup(vllm_config(path, **kwargs))


def test_plain_rope_replaces_dual_chunk_rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import DualChunkRotaryEmbedding, RotaryEmbedding

    from moba_hf.vllm import register, rope

    register()
    with set_current_vllm_config(VllmConfig()):
        rotary = DualChunkRotaryEmbedding(D, D, 4096, 1e4, True, torch.float32, chunk_size=1023, local_size=127)
        plain = RotaryEmbedding(D, D, 4096, 1e4, True, torch.float32)
    assert isinstance(rotary, rope.PlainRotaryEmbedding)
    positions, q, k = torch.arange(7) * 300, torch.randn(7, HQ * D), torch.randn(7, HKV * D)
    got, want = rotary.forward_native(positions, q.clone(), k.clone()), plain.forward_native(positions, q, k)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
