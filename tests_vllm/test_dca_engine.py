"""Dual Chunk Attention through vLLM + the plugin against the transformers path (slow: engines).

Engines (one subprocess each, shared by the tests of this module), all with chunked prefill (640-token
steps, boundaries inside DCA chunks) and the prefix cache on:
  dense   SmolLM2, sparse = false, DCA with pretraining_length 1024 (c = 1024, s = 896)
  moba    SmolLM2, DCA as above + MoBA block 128 / top 3 / last layer dense, decode "moba"
  qwen    a small Qwen2 checkpoint (SmolLM2's first layers) whose config.json carries Qwen's
          dual_chunk_attention_config and no MoBA config: the plugin turns dense DCA on by itself
Prompts of 2K-3.9K tokens span 3-5 DCA chunks, so every query variant (intra, successive, inter) runs.
"""

from __future__ import annotations

import pytest
from engines import engine_kwargs, hf_generate, logprob_gap, run_engine
from server_helpers import prompt_ids, qwen_dca_checkpoint

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
PROMPTS = [prompt_ids(2000, 11), prompt_ids(3900, 12)]
EXTENDED = PROMPTS[0] + prompt_ids(300, 13)  # its first 2000 tokens come from the prefix cache
DCA = {"pretraining_length": 1024}
DENSE = {"sparse": False, "dca": DCA}
MOBA = {"block_size": 128, "top_k": 3, "full_attn_layers": 1, "decode": "moba", "dca": DCA}
QWEN_LAYERS = 6
# first-step logprobs: dense DCA has no gate, so only float32 rounding separates the two implementations
DENSE_NATS = 1e-3
# with a gate, a near-tie between two blocks may go either way (see test_engine.GATE_TIE_NATS)
GATE_TIE_NATS = 0.25
SERVED = "moba_hf: vLLM attention runs"


def phase(prompts, separately=True):
    return {"prompts": prompts, "max_tokens": MAX_TOKENS, "separately": separately}


def dca_engine(moba: dict | None, path: str | None = None) -> dict:
    overrides = {"hf_overrides": {"moba_config": moba}} if moba is not None else {}
    engine = engine_kwargs(**overrides, max_num_batched_tokens=640, enable_prefix_caching=True)
    if path is not None:
        engine["model"] = path
    return engine


@pytest.fixture(scope="module")
def dense():
    phases = {"alone": phase(PROMPTS), "together": phase(PROMPTS, separately=False), "extended": phase([EXTENDED])}
    return run_engine({"engine": dca_engine(DENSE), "phases": phases})


@pytest.fixture(scope="module")
def moba():
    phases = {"alone": phase(PROMPTS), "together": phase(PROMPTS, separately=False), "extended": phase([EXTENDED])}
    return run_engine({"engine": dca_engine(MOBA), "phases": phases})


@pytest.fixture(scope="module")
def qwen_checkpoint(tmp_path_factory):
    return qwen_dca_checkpoint(tmp_path_factory.mktemp("qwen_dca"), QWEN_LAYERS)


@pytest.fixture(scope="module")
def qwen(qwen_checkpoint):
    return run_engine({"engine": dca_engine(None, qwen_checkpoint), "phases": {"alone": phase(PROMPTS)}})


def check_against_transformers(result: dict, moba: dict, nats: float, path: str | None = None) -> None:
    prompts = [*PROMPTS, EXTENDED] if "extended" in result else PROMPTS
    reference = hf_generate(moba, prompts, MAX_TOKENS, path=path)
    for i, (ours, hf) in enumerate(zip(result["alone"] + result.get("extended", []), reference, strict=True)):
        assert ours["tokens"] == hf["tokens"], f"prompt {i}"
        gap = logprob_gap(ours, hf["first_logprobs"])
        assert gap <= nats, f"prompt {i}: first-step logprob gap {gap:.2e} > {nats}"


@pytest.mark.parametrize("which", ["dense", "moba"])
def test_dca_matches_transformers_path(which, request):
    # chunked prefill (640-token steps) and, for the extended prompt, a 2000-token prefix from the prefix cache
    # against the transformers path's one-shot prefill
    result = request.getfixturevalue(which)
    check_against_transformers(
        result, DENSE if which == "dense" else MOBA, DENSE_NATS if which == "dense" else GATE_TIE_NATS
    )


@pytest.mark.parametrize("which", ["dense", "moba"])
def test_dca_batch_matches_each_alone(which, request):
    # together: the same prompts in one batch (cached prefixes, the last page prefilled, decodes side by side)
    result = request.getfixturevalue(which)
    for together, alone in zip(result["together"], result["alone"], strict=True):
        assert together["tokens"] == alone["tokens"]


def test_qwen_dual_chunk_attention_config_is_served_with_dca(qwen, qwen_checkpoint):
    lines = [line for line in qwen["_log"].splitlines() if SERVED in line]
    assert len(lines) == 1, lines
    assert "the checkpoint's dual_chunk_attention_config" in lines[0]
    assert "pretraining_length c=1024, chunk_size s=896" in lines[0]
    # the transformers path reads the same block with moba's default dca=None
    check_against_transformers(qwen, {"sparse": False}, DENSE_NATS, path=qwen_checkpoint)
