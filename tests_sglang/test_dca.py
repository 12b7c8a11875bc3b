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

import pytest
from server_helpers import free_port, prompt_ids, qwen_dca_checkpoint
from servers import flush_cache, generate, hf_generate, launch_command, server, server_env

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
PROMPTS = [prompt_ids(2000, 11), prompt_ids(2900, 6)]
EXTENDED = PROMPTS[0] + prompt_ids(300, 13)  # its first 2000 tokens come from the radix cache
DCA = {"pretraining_length": 1024}
MOBA = {"block_size": 128, "top_k": 3, "full_attn_layers": 1, "decode": "moba", "dca": DCA}
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
    return qwen_dca_checkpoint(tmp_path_factory.mktemp("qwen_dca"), QWEN_LAYERS)


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
