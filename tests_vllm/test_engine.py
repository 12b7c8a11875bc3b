"""vLLM + the MoBA plugin against vLLM's own attention and against the transformers path (slow: engines).

Engines (one subprocess each, shared by the tests of this module):
  baseline    vLLM's own CPU attention (plugin not loaded)
  all_blocks  MoBA with top_k covering every block: must be causal attention, token for token
  sparse      block 128 / top 2 / last layer dense, decode "moba", chunked prefill of 320 tokens, prefix cache
  preset      the shipped training-free preset (its dense tail included) with decode "full", each prompt
              prefilled in one step (the tail is per prefill call)
"""

from __future__ import annotations

import importlib.util
import json
import sys
import urllib.request

import pytest
from engines import (
    ENGINE_ENV,
    HERE,
    MAX_MODEL_LEN,
    engine_kwargs,
    hf_generate,
    logprob_gap,
    run_engine,
    start_engine_expecting_refusal,
)
from server_helpers import model_path, prompt_ids

from moba_hf import MobaConfig
from moba_hf.vllm import startup

# `vllm serve` started, awaited and stopped as benchmarks/serve_passkey.py does it
_spec = importlib.util.spec_from_file_location("serve_passkey", HERE.parent / "benchmarks" / "serve_passkey.py")
serve_passkey = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = serve_passkey
_spec.loader.exec_module(serve_passkey)
VLLM_CLI = serve_passkey.VLLM_CLI

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
SERVE_START_S = 300
SHORT = [prompt_ids(n, seed) for n, seed in ((300, 1), (900, 2), (1700, 3))]
LONG = [prompt_ids(n, seed) for n, seed in ((1100, 4), (2900, 6))]
CONCURRENT = [*LONG, SHORT[0], SHORT[1]]  # 4 requests of different lengths
EXTENDED = LONG[0] + prompt_ids(260, 7)  # LONG[0]'s prefix comes from the prefix cache
SPARSE = {"block_size": 128, "top_k": 2, "full_attn_layers": 1, "decode": "moba"}
PRESET = {**MobaConfig.preset("training-free").to_dict(), "decode": "full"}
ALL_BLOCKS = {"block_size": 128, "top_k": 4096 // 128, "decode": "moba"}
# First-step logprobs. Without a gate (top_k covering every block) flash-attention's rule holds: the plugin's
# gap to vLLM's own attention is at most twice the gap between two float32 implementations of the same dense
# model (vLLM against transformers' SDPA), plus 1e-4 for rounding below that (logprobs ~10 * 2**-23 * 30 layers).
FLOOR = 1e-4
# With a gate, two float32 implementations whose keys differ by rounding (~1e-6 relative) may pick different
# blocks where two blocks' gate scores tie to that precision; over ~10^5 (query, head, layer) choices a few such
# near-ties are expected, and each moves the output of one query. Greedy tokens must still agree exactly; the
# first-step logprobs may move by up to this much (the largest seen: 0.12 nats, block 128 / top 2).
GATE_TIE_NATS = 0.25


def phase(prompts, separately=True, max_tokens=MAX_TOKENS):
    return {"prompts": prompts, "max_tokens": max_tokens, "separately": separately}


@pytest.fixture(scope="module")
def baseline():
    job = {"engine": engine_kwargs(), "phases": {"short": phase(SHORT), "long": phase(LONG, max_tokens=1)}}
    return run_engine(job, env={"VLLM_PLUGINS": "none"})


@pytest.fixture(scope="module")
def all_blocks():
    engine = engine_kwargs(hf_overrides={"moba_config": ALL_BLOCKS})
    return run_engine({"engine": engine, "phases": {"short": phase(SHORT)}})


@pytest.fixture(scope="module")
def sparse():
    engine = engine_kwargs(hf_overrides={"moba_config": SPARSE}, max_num_batched_tokens=320, enable_prefix_caching=True)
    phases = {
        "alone": phase(CONCURRENT),
        "together": phase(CONCURRENT, separately=False),
        "repeat": phase([LONG[0]]),
        "extended": phase([EXTENDED]),
    }
    return run_engine({"engine": engine, "phases": phases})


@pytest.fixture(scope="module")
def preset():
    # room for all four prompts in one step: a prompt cut into chunks would get a dense tail per chunk
    engine = engine_kwargs(hf_overrides={"moba_config": PRESET}, max_num_batched_tokens=sum(map(len, CONCURRENT)))
    phases = {"alone": phase(CONCURRENT), "together": phase(CONCURRENT, separately=False)}
    return run_engine({"engine": engine, "phases": phases})


@pytest.fixture(scope="module")
def hf_dense():
    return hf_generate(None, LONG, 1)  # first-step logprobs only


@pytest.fixture(scope="module")
def tolerance(baseline, hf_dense):
    gap = max(logprob_gap(v, h["first_logprobs"]) for v, h in zip(baseline["long"], hf_dense, strict=True))
    return 2 * gap + FLOOR


def test_all_blocks_equals_vllm_attention(baseline, all_blocks, tolerance):
    for ours, theirs in zip(all_blocks["short"], baseline["short"], strict=True):
        assert ours["tokens"] == theirs["tokens"]
        first = {int(t): lp for t, lp in theirs["logprobs"][0].items()}
        gap = logprob_gap(ours, _Lookup(first))
        assert gap <= tolerance, f"first-step logprob gap {gap:.2e} > {tolerance:.2e}"


class _Lookup(dict):
    def __getitem__(self, token):  # a token outside vLLM's top 5: compare nothing for it
        return self.get(token, float("nan"))


@pytest.mark.parametrize("which", ["sparse", "preset"])
def test_matches_transformers_path(which, request):
    result = request.getfixturevalue(which)
    moba = SPARSE if which == "sparse" else PRESET
    reference = hf_generate(moba, LONG, MAX_TOKENS)
    for i, (ours, hf) in enumerate(zip(result["alone"], reference, strict=False)):
        assert ours["tokens"] == hf["tokens"], f"prompt {i} ({len(LONG[i])} tokens)"
        gap = logprob_gap(ours, hf["first_logprobs"])
        assert gap <= GATE_TIE_NATS, f"prompt {i}: first-step logprob gap {gap:.2e} > {GATE_TIE_NATS}"


def test_chunked_prefill_and_prefix_cache_match_one_shot(sparse):
    # the sparse engine prefills in chunks of 320 tokens (boundaries inside MoBA blocks of 128): its results
    # equal the transformers path's one-shot prefill (test above); a prompt served from the prefix cache
    # (repeat) and one extending a cached prompt (extended) must give what a fresh prefill gives
    assert sparse["repeat"][0]["tokens"] == sparse["alone"][0]["tokens"]
    reference = hf_generate(SPARSE, [EXTENDED], MAX_TOKENS)[0]
    assert sparse["extended"][0]["tokens"] == reference["tokens"]


@pytest.mark.parametrize("which", ["sparse", "preset"])
def test_concurrent_requests_match_each_alone(which, request):
    result = request.getfixturevalue(which)
    for together, alone in zip(result["together"], result["alone"], strict=True):
        assert together["tokens"] == alone["tokens"]


def test_engine_refuses_bad_config_at_startup():
    output = start_engine_expecting_refusal(engine_kwargs(hf_overrides={"moba_config": {"top_k": 0}}))
    assert "moba_hf: bad MoBA config from --hf-overrides moba_config: top_k must be an integer >= 1" in output


def test_vllm_serve_returns_offline_text(preset, tmp_path):
    """`vllm serve` with MOBA_HF_CONFIG (a server file with the preset engine's settings) answers an
    OpenAI-style completion over HTTP with the offline engine's text."""
    config = tmp_path / "server.toml"
    config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in PRESET.items() if v is not None))
    port = serve_passkey.free_port()
    command = [
        sys.executable, "-c", VLLM_CLI, "serve", model_path(), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--seed", "0",
    ]  # fmt: skip
    log = tmp_path / "serve.log"
    with serve_passkey.vllm_server(command, {**ENGINE_ENV, startup.ENV: str(config)}, log, SERVE_START_S) as base:
        body = {"model": model_path(), "prompt": LONG[0], "max_tokens": MAX_TOKENS, "temperature": 0.0}
        request = urllib.request.Request(
            f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
    assert answer["choices"][0]["text"] == preset["alone"][0]["text"]
    assert "moba_hf: vLLM attention runs" in log.read_text()
