"""SGLang + the MoBA plugin against the transformers path (slow: one server for the module).

The server runs block 128 / top 2 / last layer dense / decode "moba" with --chunked-prefill-size 512, so every
long prompt is prefilled in chunks (boundaries inside MoBA blocks) while the transformers path prefills it in one
step; the radix cache is on (SGLang's default). On these prompts MoBA's greedy tokens differ from dense
attention's, so a server whose backend did not run MoBA fails.
"""

from __future__ import annotations

import concurrent.futures
import json

import pytest
from server_helpers import free_port, prompt_ids
from servers import flush_cache, generate, hf_generate, launch_command, server, server_env

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
SPARSE = {"block_size": 128, "top_k": 2, "full_attn_layers": 1, "decode": "moba"}
LONG = [prompt_ids(n, seed) for n, seed in ((2100, 4), (2900, 6))]
SHORT = prompt_ids(700, 1)
MIXED = [LONG[1], SHORT, LONG[0]]  # one batch of different lengths
EXTENDED = LONG[0] + prompt_ids(300, 7)  # LONG[0]'s prefix comes from the radix cache


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    log = tmp_path_factory.mktemp("sparse") / "server.log"
    port = free_port()
    args = ["--attention-backend", "moba", "--chunked-prefill-size", "512",
            "--json-model-override-args", json.dumps({"moba_config": SPARSE})]  # fmt: skip
    results = {}
    with server(launch_command(*args, port=port), server_env(), log, port) as base:
        results["alone"] = []
        for ids in MIXED:
            flush_cache(base)  # cold: nothing from the radix cache
            results["alone"].append(generate(base, ids, MAX_TOKENS))
        flush_cache(base)
        with concurrent.futures.ThreadPoolExecutor(len(MIXED)) as pool:
            results["together"] = list(pool.map(lambda ids: generate(base, ids, MAX_TOKENS), MIXED))
        results["repeat"] = generate(base, LONG[0], MAX_TOKENS)  # LONG[0] is in the radix cache now
        results["extended"] = generate(base, EXTENDED, MAX_TOKENS)
    results["log"] = log.read_text(errors="replace")
    return results


@pytest.fixture(scope="module")
def reference():
    moba = hf_generate(SPARSE, [*LONG, EXTENDED], MAX_TOKENS)
    return {"moba": moba, "dense": hf_generate(None, LONG[:1], MAX_TOKENS)}  # one prompt suffices to tell


def test_prompts_tell_moba_from_dense(reference):
    assert any(m != d for m, d in zip(reference["moba"], reference["dense"], strict=False)), (
        "MoBA and dense attention give the same tokens on every prompt: the tests below could not tell them apart"
    )


def test_chunked_prefill_matches_transformers_one_shot(sparse, reference):
    assert "moba_hf: SGLang attention runs MobaConfig(block_size=128, top_k=2" in sparse["log"]
    alone = {len(ids): r["tokens"] for ids, r in zip(MIXED, sparse["alone"], strict=True)}
    for ids, expected in zip(LONG, reference["moba"], strict=False):
        assert alone[len(ids)] == expected, f"{len(ids)}-token prompt"


def test_mixed_batch_matches_each_alone(sparse):
    for together, alone in zip(sparse["together"], sparse["alone"], strict=True):
        assert together["tokens"] == alone["tokens"]


def test_radix_cache_hit_matches_cold(sparse, reference):
    repeat, extended = sparse["repeat"], sparse["extended"]
    assert repeat["cached"] > 0 and extended["cached"] >= len(LONG[0]) - 1, (repeat["cached"], extended["cached"])
    assert repeat["tokens"] == sparse["alone"][2]["tokens"]
    assert extended["tokens"] == reference["moba"][2]


def test_server_refuses_bad_config_at_startup(tmp_path):
    from servers import start_expecting_refusal

    args = ["--attention-backend", "moba", "--json-model-override-args", json.dumps({"moba_config": {"top_k": 0}})]
    output = start_expecting_refusal(launch_command(*args, port=free_port()), server_env(), tmp_path / "server.log")
    assert (
        "moba_hf: bad MoBA config from --json-model-override-args moba_config: top_k must be an integer >= 1" in output
    )
