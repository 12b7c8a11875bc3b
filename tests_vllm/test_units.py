"""The plugin's pieces without an engine: paged MoBA over vLLM's CPU cache layout, the startup refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import MAX_MODEL_LEN, model_path
from vllm import _custom_ops as ops

from moba_hf import MobaConfig, causal_attention, moba_attention
from moba_hf.vllm import backend, settings
from moba_hf.vllm.paged import moba_paged

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
# prefix of 96 tokens (three pages, one and a half MoBA blocks), a one-token prompt
SEQ_LENS = [70, 75, 150, 200, 1]
QUERY_LENS = [70, 1, 40, 104, 1]


@pytest.mark.parametrize(
    "config",
    [
        MobaConfig(block_size=64, top_k=2),
        MobaConfig(block_size=48, top_k=3, pooling="bound", sink_blocks=1, local_blocks=1),
        MobaConfig(block_size=20, top_k=2, decode="full", pooling="mean+max"),
    ],
    ids=["blk64-k2", "blk48-k3-bound-sink1-local1", "blk20-k2-decodefull"],
)
def test_mixed_batch_equals_moba_attention_per_sequence(config):
    kv_cache, table, starts, keys, values, query, key, value = paged_batch(SEQ_LENS, QUERY_LENS)
    key_cache, value_cache = backend.cache_views(kv_cache)
    output = torch.full_like(query, float("nan"))
    scale = D**-0.5
    moba_paged(
        query, key, value, key_cache, value_cache, output,
        query_start_loc=starts, seq_lens=SEQ_LENS, block_table=table, config=config, scale=scale,
    )  # fmt: skip
    gate = dict(pooling=config.pooling, sink_blocks=config.sink_blocks, local_blocks=config.local_blocks)
    for i, nq in enumerate(QUERY_LENS):
        q = query[starts[i] : starts[i + 1]].transpose(0, 1)[None]
        k, v = keys[i].transpose(0, 1)[None], values[i].transpose(0, 1)[None]
        if nq == 1 and config.decode == "full":
            want = causal_attention(q, k, v, scale=scale)
        else:
            want = moba_attention(q, k, v, block_size=config.block_size, top_k=config.top_k, scale=scale, **gate)
        got = output[starts[i] : starts[i + 1]].transpose(0, 1)[None]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"sequence {i}")


def test_skip_decodes_leaves_decode_rows_to_the_caller():
    kv_cache, table, starts, _, _, query, key, value = paged_batch(SEQ_LENS, QUERY_LENS)
    key_cache, value_cache = backend.cache_views(kv_cache)
    output = torch.full_like(query, float("nan"))
    moba_paged(
        query, key, value, key_cache, value_cache, output, query_start_loc=starts, seq_lens=SEQ_LENS,
        block_table=table, config=MobaConfig(block_size=64, top_k=2, decode="full"), scale=D**-0.5,
        skip_decodes=True,
    )  # fmt: skip
    for i, nq in enumerate(QUERY_LENS):
        rows = output[starts[i] : starts[i + 1]]
        assert bool(rows.isnan().all()) == (nq == 1)


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
    config, dense = backend._setup(vllm_config())
    assert config == MobaConfig.preset("training-free") and dense == {27, 28, 29}
    config, dense = backend._setup(vllm_config(hf_overrides={"moba_config": {"block_size": 256, "top_k": 2}}))
    assert config == MobaConfig(block_size=256, top_k=2) and dense == frozenset()


@pytest.mark.parametrize("name", ["long_doc", "chat", "code"])
def test_serving_configs(name, monkeypatch):
    monkeypatch.setenv(settings.ENV, str(ROOT / "configs" / f"serving_{name}.toml"))
    config, dense = backend._setup(vllm_config())
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
    "dca": (dict(hf_overrides={"moba_config": {"dca": True}}), "does not run Dual Chunk Attention"),
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


def test_refuses_unsupported_architecture(monkeypatch, tmp_path):
    monkeypatch.setenv(settings.ENV, "training-free")
    path = model_dir(tmp_path, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    message = "supports LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM; this checkpoint is MistralForCausalLM"
    with pytest.raises(settings.MobaSetupError, match=message):
        backend._setup(vllm_config(path))


def test_refuses_sliding_window(monkeypatch, tmp_path):
    monkeypatch.setenv(settings.ENV, "training-free")
    path = model_dir(
        tmp_path, model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
        sliding_window=1024, max_window_layers=0,
    )  # fmt: skip
    with pytest.raises(settings.MobaSetupError, match="sliding"):
        backend._setup(vllm_config(path))
