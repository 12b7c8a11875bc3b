"""Dual Chunk Attention through SGLang + the plugin against the transformers path (slow: two servers).

Servers (one each, shared by the tests of this module), both with --chunked-prefill-size 512 (chunk boundaries
inside DCA chunks) and the radix cache on:
  moba    SmolLM2, DCA pretraining_length 1024 (c = 1024, s = 896) + MoBA block 128 / top 3 / last layer dense
          (dense DCA there), decode "moba"
  qwen    a small Qwen2 checkpoint (SmolLM2's first layers) whose config.json carries Qwen's
          dual_chunk_attention_config and no MoBA config: the plugin turns dense DCA on by itself, and SGLang's
          Qwen2 builds its DualChunkRotaryEmbedding, which the plugin's plain RoPE stands in for
Prompts of 2K-2.9K tokens span 3-4 DCA chunks, so every query variant (intra, successive, inter) runs.
"""

from __future__ import annotations

import json
import shutil

import pytest
from server_helpers import free_port, model_path, prompt_ids
from servers import flush_cache, generate, hf_generate, launch_command, server, server_env

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
PROMPTS = [prompt_ids(2000, 11), prompt_ids(2900, 6)]
EXTENDED = PROMPTS[0] + prompt_ids(300, 13)  # its first 2000 tokens come from the radix cache
DCA = {"pretraining_length": 1024}
MOBA = {"block_size": 128, "top_k": 3, "full_attn_layers": 1, "decode": "moba", "dca": DCA}
# Qwen's convention: c = chunk_size + 1, s = chunk_size - local_size (the transformers path's mapping)
QWEN_DCA = {"chunk_size": 1023, "local_size": 127, "original_max_position_embeddings": 1024}
QWEN_LAYERS = 6
SERVED = "moba_hf: SGLang attention runs"
DCA_LINE = "Dual Chunk Attention: pretraining_length c=1024, chunk_size s=896"


def serve(name: str, tmp_path_factory, args: list[str], path: str | None = None) -> dict:
    """Each prompt cold, then EXTENDED after a radix-cache hit (MAX_TOKENS tokens each, EOS or not: the model
    answers EOS first on some of these prompts); the server's log."""
    log = tmp_path_factory.mktemp(name) / "server.log"
    port = free_port()
    command = launch_command("--attention-backend", "moba", "--chunked-prefill-size", "512", *args, port=port,
                             path=path)  # fmt: skip
    results = {}
    with server(command, server_env(), log, port) as base:
        alone = {}
        for i in reversed(range(len(PROMPTS))):  # PROMPTS[0] last: it stays in the radix cache for EXTENDED
            flush_cache(base)
            alone[i] = generate(base, PROMPTS[i], MAX_TOKENS, ignore_eos=True)
        results["alone"] = [alone[i] for i in range(len(PROMPTS))]
        results["extended"] = generate(base, EXTENDED, MAX_TOKENS, ignore_eos=True)
    results["log"] = log.read_text(errors="replace")
    return results


@pytest.fixture(scope="module")
def moba(tmp_path_factory):
    return serve("moba", tmp_path_factory, ["--json-model-override-args", json.dumps({"moba_config": MOBA})])


@pytest.fixture(scope="module")
def qwen_checkpoint(tmp_path_factory):
    """SmolLM2's first layers as a Qwen2 checkpoint (zero q / k / v biases) with a dual_chunk_attention_config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    source = model_path()
    llama = AutoConfig.from_pretrained(source)
    config = Qwen2Config(
        vocab_size=llama.vocab_size, hidden_size=llama.hidden_size, intermediate_size=llama.intermediate_size,
        num_hidden_layers=QWEN_LAYERS, num_attention_heads=llama.num_attention_heads,
        num_key_value_heads=llama.num_key_value_heads, max_position_embeddings=llama.max_position_embeddings,
        rope_parameters=dict(llama.rope_parameters), rms_norm_eps=llama.rms_norm_eps, tie_word_embeddings=True,
        use_sliding_window=False, bos_token_id=llama.bos_token_id, eos_token_id=llama.eos_token_id,
        dual_chunk_attention_config=QWEN_DCA,
    )  # fmt: skip
    weights = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    model = Qwen2ForCausalLM(config).to(torch.float32)
    missing, _ = model.load_state_dict(weights, strict=False)
    assert all(name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) for name in missing), missing
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.zero_()
    path = tmp_path_factory.mktemp("qwen_dca")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{source}/{name}", path / name)
    assert json.loads((path / "config.json").read_text())["dual_chunk_attention_config"] == QWEN_DCA
    return str(path)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, qwen_checkpoint):
    return serve("qwen", tmp_path_factory, [], path=qwen_checkpoint)


def check_against_transformers(result: dict, moba: dict, path: str | None = None) -> None:
    reference = hf_generate(moba, [*PROMPTS, EXTENDED], MAX_TOKENS, path=path, ignore_eos=True)
    for i, (ours, hf) in enumerate(zip([*result["alone"], result["extended"]], reference, strict=True)):
        assert ours["tokens"] == hf, f"prompt {i}"
    assert result["extended"]["cached"] >= len(PROMPTS[0]) - 1, result["extended"]["cached"]


def test_dca_with_moba_matches_transformers_path(moba):
    # chunked prefill (512-token steps) and, for the extended prompt, a 2000-token prefix from the radix cache,
    # against the transformers path's one-shot prefill; the last layer runs dense DCA, the others DCA + MoBA
    lines = [line for line in moba["log"].splitlines() if SERVED in line]
    assert lines and all(DCA_LINE in line for line in lines), lines
    check_against_transformers(moba, MOBA)


def test_qwen_dual_chunk_attention_config_is_served_with_dense_dca(qwen, qwen_checkpoint):
    lines = [line for line in qwen["log"].splitlines() if SERVED in line]
    assert lines, qwen["log"][-3000:]
    assert all("the checkpoint's dual_chunk_attention_config" in line and DCA_LINE in line for line in lines), lines
    # the transformers path reads the same block with moba's default dca=None
    check_against_transformers(qwen, {"sparse": False}, path=qwen_checkpoint)
