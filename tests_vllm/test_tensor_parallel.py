"""vLLM tensor parallelism with the MoBA plugin: tensor_parallel_size=2 gives what 1 gives (slow: engines).

The checkpoint is a tiny random Llama (tiny_model.py: 8 query / 2 KV heads, 2 layers), so each of two ranks
holds 4 query heads and 1 KV head. One job per TP size runs these engines one after another in one process:
  moba      block 64 / top 2, layer 1 dense (vLLM's kernel), decode "moba"
  dca_moba  the same with DCA pretraining_length 512 (c 512, s 448): layer 0 DCA + MoBA, layer 1 dense DCA
Prompts of 1000 tokens (16 MoBA blocks, 3 DCA chunks) and 300 tokens (5 blocks, one chunk), each alone.
TP=2 runs one rank per core (VLLM_CPU_OMP_THREADS_BIND="a|b", two cores this process may run on), TP=1 on the
first of them; the two jobs run at the same time (an engine start is mostly one process importing at a time).

The only sparse layer is layer 0, whose inputs are the embedding rows on both TP sizes (the vocab-parallel
embedding's all-reduce adds zeros), so its gate scores differ at most by the q / k projection's rounding: a
gate near-tie cannot flip between the two runs the way it could in a layer after an all-reduce.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from engines import run_engine
from server_helpers import model_path, prompt_ids
from tiny_model import write_tiny_llama

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 2048
MAX_TOKENS = 8
PROMPTS = [prompt_ids(1000, 21), prompt_ids(300, 22)]
BLOCK, TOP_K = 64, 2
MOBA = {"block_size": BLOCK, "top_k": TOP_K, "full_attn_layers": 1, "decode": "moba"}
CONFIGS = {"moba": MOBA, "dca_moba": {**MOBA, "dca": {"pretraining_length": 512}}}
SERVED = "moba_hf: vLLM attention runs"
# KV cache per rank (engines.ENGINE_ENV's VLLM_CPU_KVCACHE_SPACE, whole GiB, would override it): three workers
# run at once
KV_CACHE_BYTES = 128 << 20
# TP=2 against TP=1, prompt and step logprobs. Both runs use the same float32 kernels on the same heads; TP=2
# adds an all-reduce after each row-parallel projection (o_proj and down_proj: 4 in 2 layers), which adds the two
# ranks' partial sums in another order than one rank's single GEMM does (the embedding's all-reduce adds zeros and
# the logits are gathered, both exact). Each such sum moves by a few float32 roundings (u = 2**-24) relative to the
# residual stream; through the final norm and the tied LM head the logits z move by about 4 * few * u * |z|, and
# log_softmax at most doubles that. RELATIVE = 1e-5 (~170 u) of the largest |logprob| leaves a factor ~10 for
# growth through attention and the MLP. Measured 2026-12-03 on a 2-core x86_64 box: at most 5.7e-6 nats at
# |logprob| <= 15.8 (3.6e-7 relative), against a bound of 1.6e-4.
RELATIVE = 1e-5
# the transformers path's dense attention against vLLM where MoBA is dense too (the first TOP_K blocks): two
# float32 implementations of the same model (as test_dca_engine.DENSE_NATS; 6.7e-6 measured)
DENSE_NATS = 1e-3
# past them the sparse configs must differ from dense attention by far more than that (3.8-5.2 nats measured)
SPARSE_NATS = 100 * DENSE_NATS


def bound_cores() -> list[int]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"tensor_parallel_size=2 needs 2 cores to bind one rank each; this process may run on {cores}")
    return cores[:2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), model_path(), MAX_MODEL_LEN)


def job(path: str, tp: int) -> dict:
    phases = {"alone": {"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "separately": True, "prompt_logprobs": True}}
    engines = {}
    for label, moba in CONFIGS.items():
        engine = dict(
            model=path, dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True, seed=0,
            tensor_parallel_size=tp, kv_cache_memory_bytes=KV_CACHE_BYTES, hf_overrides={"moba_config": moba},
        )  # fmt: skip
        engines[label] = {"engine": engine, "phases": phases}
    return {"engines": engines}


@pytest.fixture(scope="module")
def runs(checkpoint) -> tuple[dict, dict]:
    """The TP=1 and TP=2 jobs' results, both jobs at once (TP=1 shares the first core with TP=2's rank 0)."""
    a, b = bound_cores()
    kv = {"VLLM_CPU_KVCACHE_SPACE": None}  # unset: KV_CACHE_BYTES holds
    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(run_engine, job(checkpoint, 1), {**kv, "VLLM_CPU_OMP_THREADS_BIND": f"{a}"})
        two = pool.submit(run_engine, job(checkpoint, 2), {**kv, "VLLM_CPU_OMP_THREADS_BIND": f"{a}|{b}"})
        return one.result(), two.result()


@pytest.fixture(scope="module")
def tp1(runs):
    return runs[0]


@pytest.fixture(scope="module")
def tp2(runs):
    return runs[1]


@pytest.fixture(scope="module")
def dense_logprobs(checkpoint):
    """The transformers path's prompt logprobs with dense attention (SDPA), per prompt: [None, lp_1, ...]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa").eval()
    out = []
    with torch.inference_mode():
        for ids in PROMPTS:
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
            out.append([None] + logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist())
    return out


def step_logprobs(result: dict) -> list[float]:
    return [step[str(t)] for t, step in zip(result["tokens"], result["logprobs"], strict=True)]


@pytest.mark.parametrize("label", list(CONFIGS))
def test_tp2_greedy_tokens_equal_tp1(label, tp1, tp2):
    for i, (one, two) in enumerate(zip(tp1[label]["alone"], tp2[label]["alone"], strict=True)):
        assert len(one["tokens"]) == MAX_TOKENS, f"prompt {i}: {one['tokens']}"
        assert two["tokens"] == one["tokens"], f"prompt {i} ({len(PROMPTS[i])} tokens)"


@pytest.mark.parametrize("label", list(CONFIGS))
def test_tp2_logprobs_equal_tp1_to_rounding(label, tp1, tp2):
    for i, (one, two) in enumerate(zip(tp1[label]["alone"], tp2[label]["alone"], strict=True)):
        a = one["prompt_logprobs"][1:] + step_logprobs(one)
        b = two["prompt_logprobs"][1:] + step_logprobs(two)
        assert len(a) == len(b) == len(PROMPTS[i]) - 1 + MAX_TOKENS
        tolerance = RELATIVE * max(map(abs, a))
        gap = max(abs(x - y) for x, y in zip(a, b, strict=True))
        assert gap <= tolerance, f"prompt {i}: TP=2 logprobs differ from TP=1 by {gap:.2e} > {tolerance:.2e}"


@pytest.mark.parametrize("label", list(CONFIGS))
def test_configs_are_sparse(label, tp1, dense_logprobs):
    # the same model as the transformers path where MoBA attends to every block, and far from it past there:
    # the gate really drops blocks (and, for dca_moba, DCA moves the keys past its first chunk)
    dense_until = TOP_K * BLOCK
    for i, (ours, dense) in enumerate(zip(tp1[label]["alone"], dense_logprobs, strict=True)):
        gaps = [abs(x - y) for x, y in zip(ours["prompt_logprobs"][1:], dense[1:], strict=True)]
        assert max(gaps[: dense_until - 1]) <= DENSE_NATS, f"prompt {i}: dense positions differ"
        assert max(gaps[dense_until - 1 :]) > SPARSE_NATS, f"prompt {i}: {label} gives dense attention's logprobs"


def test_every_rank_runs_the_plugin(tp1, tp2):
    # each rank's worker builds the MoBA backend and logs the config once per engine
    for tp, result in ((1, tp1), (2, tp2)):
        lines = [line for line in result["_log"].splitlines() if SERVED in line]
        assert len(lines) == tp * len(CONFIGS), lines
        dca = [line for line in lines if "Dual Chunk Attention: pretraining_length c=512, chunk_size s=448" in line]
        assert len(dca) == tp, lines
        assert all("dense layers [1]" in line for line in lines), lines
