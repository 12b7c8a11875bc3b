"""What the plugin decides when vLLM builds its attention layers, without starting an engine: config sources and
precedence, the startup refusals, where DCA comes from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from engines import MAX_MODEL_LEN
from server_helpers import model_path

from moba_hf import MobaConfig, core
from moba_hf.dca.config import DcaParams
from moba_hf.vllm import startup

ROOT = Path(__file__).resolve().parents[1]
HQ, HKV, D = 6, 2, 64


# --- configuration and refusals (the same function the engine runs when it builds its attention layers) ------
def vllm_config(model: str | None = None, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=model or model_path(), dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True)
    return EngineArgs(**{**args, **kwargs}).create_engine_config()


def test_no_moba_config_leaves_vllm_alone(monkeypatch):
    monkeypatch.delenv(startup.ENV, raising=False)
    assert startup.setup(vllm_config()) is None


def test_a_null_moba_config_override_turns_moba_off(monkeypatch, tmp_path):
    """null means "no MoBA": not the defaults, and not the environment's or the checkpoint's config either."""
    monkeypatch.setenv(startup.ENV, "training-free")
    assert startup.setup(vllm_config(hf_overrides={"moba_config": None})) is None


def test_sources_and_precedence(monkeypatch):
    monkeypatch.setenv(startup.ENV, "training-free")
    config, plan, dca, _ = startup.setup(vllm_config())
    preset = MobaConfig.preset("training-free")
    assert config == preset and plan == core.plan_for(preset, 30) and dca is None
    config, plan, _, _ = startup.setup(vllm_config(hf_overrides={"moba_config": {"block_size": 256, "top_k": 2}}))
    assert config == MobaConfig(block_size=256, top_k=2) and plan.full_layers == frozenset()


@pytest.mark.parametrize("name", ["long_doc", "chat", "code"])
def test_serving_configs(name, monkeypatch):
    monkeypatch.setenv(startup.ENV, str(ROOT / "configs" / f"serving_{name}.toml"))
    config, plan, _, _ = startup.setup(vllm_config())
    expected = {
        "long_doc": (MobaConfig(block_size=4096, top_k=4, full_attn_layers=2, decode="full"), {28, 29}),
        "chat": (MobaConfig(block_size=2048, top_k=3, decode="full"), set()),
        "code": (MobaConfig(block_size=8192, top_k=5, decode="full"), set()),
    }[name]
    assert (config, plan.full_layers) == expected


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
    monkeypatch.delenv(startup.ENV, raising=False)
    kwargs, message = REFUSALS[case]
    with pytest.raises(startup.MobaSetupError, match=message):
        startup.setup(vllm_config(**kwargs))


def test_refuses_unknown_preset(monkeypatch):
    monkeypatch.setenv(startup.ENV, "no-such-preset")
    with pytest.raises(startup.MobaSetupError, match="neither a preset"):
        startup.setup(vllm_config())


def test_refuses_server_file_limits(monkeypatch, tmp_path):
    path = tmp_path / "server.toml"
    path.write_text("block_size = 256\ntop_k = 3\nmax_context_tokens = 2048\n")
    monkeypatch.setenv(startup.ENV, str(path))
    with pytest.raises(startup.MobaSetupError, match="max_context_tokens=2048"):
        startup.setup(vllm_config())


@pytest.mark.parametrize("spelling", ["fp16", "float16", "half", "FP16"])
def test_server_file_kv_cache_dtype_spellings_match_vllm_flags(spelling, monkeypatch, tmp_path):
    path = tmp_path / "server.toml"
    path.write_text(f'[attention]\ntype = "moba"\nblock_size = 256\n[attention.kv_cache]\ndtype = "{spelling}"\n')
    monkeypatch.setenv(startup.ENV, str(path))
    assert startup.setup(vllm_config(dtype="float16")) is not None  # the KV cache follows --dtype (auto)
    assert startup.setup(vllm_config(dtype="half", kv_cache_dtype="float16")) is not None


def test_kv_cache_dtype_refusal_names_flags_vllm_accepts(monkeypatch, tmp_path):
    from typing import get_args

    from vllm.config.cache import CacheDType
    from vllm.config.model import ModelDType

    path = tmp_path / "server.json"
    path.write_text('{"block_size": 256, "kv_cache_dtype": "bf16"}')
    monkeypatch.setenv(startup.ENV, str(path))
    with pytest.raises(startup.MobaSetupError, match="asks for kv_cache_dtype='bfloat16'") as refused:
        startup.setup(vllm_config())  # float32 model, cache auto
    flags = dict(re.findall(r"(--dtype|--kv-cache-dtype) ([\w.]+)", str(refused.value).split("start vLLM with")[1]))
    assert flags["--dtype"] == "bfloat16" and flags["--dtype"] in get_args(ModelDType)
    assert flags["--kv-cache-dtype"] in get_args(CacheDType)
    assert startup.setup(vllm_config(dtype=flags["--dtype"], kv_cache_dtype=flags["--kv-cache-dtype"])) is not None


def test_refuses_unsupported_architecture(monkeypatch, tmp_path):
    monkeypatch.setenv(startup.ENV, "training-free")
    path = model_dir(tmp_path, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    message = "supports LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM; this checkpoint is MistralForCausalLM"
    with pytest.raises(startup.MobaSetupError, match=message):
        startup.setup(vllm_config(path))


def test_refuses_max_model_len_past_the_rope_table(monkeypatch, tmp_path):
    monkeypatch.delenv(startup.ENV, raising=False)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own length check comes first otherwise
    path = model_dir(tmp_path, max_position_embeddings=2048)
    message = "max_model_len=4096 needs RoPE positions up to 4095, but vLLM's RoPE table covers max_position_embeddings"
    with pytest.raises(startup.MobaSetupError, match=re.escape(message)):
        startup.setup(vllm_config(path, hf_overrides={"moba_config": {"block_size": 128}}))
    # raising the table through --hf-overrides is accepted
    raised = {"moba_config": {"block_size": 128}, "max_position_embeddings": 4096}
    assert startup.setup(vllm_config(path, hf_overrides=raised)) is not None


def test_refuses_sliding_window(monkeypatch, tmp_path):
    monkeypatch.setenv(startup.ENV, "training-free")
    path = model_dir(
        tmp_path, model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
        sliding_window=1024, max_window_layers=0,
    )  # fmt: skip
    with pytest.raises(startup.MobaSetupError, match="sliding"):
        startup.setup(vllm_config(path))


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

    monkeypatch.delenv(startup.ENV, raising=False)
    moba = {"sparse": False, "dca": {"pretraining_length": 1024, "temperature": True}}
    setup = startup.setup(vllm_config(hf_overrides={"moba_config": moba}))
    assert setup.dca.params == DcaParams(pretraining_length=1024, chunk_size=896, temperature=True)
    model = AutoConfig.from_pretrained(model_path())
    head_dim = model.hidden_size // model.num_attention_heads
    want = 1.0 / model.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
    torch.testing.assert_close(setup.dca.inv_freq, want)
    moba = {"block_size": 128, "top_k": 2, "dca": {"pretraining_length": 1024}}
    assert startup.setup(vllm_config(hf_overrides={"moba_config": moba})).dca.params.chunk_size == 896


def test_qwen_dual_chunk_attention_config_turns_dense_dca_on(monkeypatch, tmp_path):
    monkeypatch.delenv(startup.ENV, raising=False)
    path = qwen_dir(tmp_path, dual_chunk_attention_config=QWEN_DCA)
    config, plan, dca, _ = startup.setup(vllm_config(path))
    assert config == MobaConfig(sparse=False) and dca.params == DcaParams(pretraining_length=1024, chunk_size=896)
    assert plan.dca == dca.params and not plan.sparse
    off = startup.setup(vllm_config(path, hf_overrides={"moba_config": {"block_size": 128, "dca": False}}))
    assert off.dca is None and off.config.sparse


def test_dca_accepts_llama3_rope(monkeypatch, tmp_path):
    monkeypatch.delenv(startup.ENV, raising=False)
    path = model_dir(tmp_path, rope_scaling=LLAMA3_ROPE)
    moba = {"sparse": False, "dca": {"pretraining_length": 1024}}
    assert startup.setup(vllm_config(path, hf_overrides={"moba_config": moba})).dca is not None


def test_dca_past_the_window_with_a_raised_rope_table(monkeypatch):
    # SmolLM2 (8K window) at 16K: vLLM's RoPE table raised to 16K, DCA's c set explicitly
    monkeypatch.delenv(startup.ENV, raising=False)
    moba = {"sparse": False, "dca": {"pretraining_length": 4096, "temperature": True}}
    overrides = {"max_position_embeddings": 16384, "moba_config": moba}
    setup = startup.setup(vllm_config(hf_overrides=overrides, max_model_len=16384))
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
    monkeypatch.delenv(startup.ENV, raising=False)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own length check comes first otherwise
    checkpoint, kwargs, message = DCA_REFUSALS[case]
    path = model_dir(tmp_path, **checkpoint) if checkpoint else None
    with pytest.raises(startup.MobaSetupError, match=re.escape(message)):
        startup.setup(vllm_config(path, **kwargs))


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
