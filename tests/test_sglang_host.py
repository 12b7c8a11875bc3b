"""The SGLang plugin's host-side parts that need no SGLang: the per-sequence attention over SGLang's KV pool
(`moba_hf.sglang.pool`) reaching the core and nothing else, and where the server's config comes from
(`moba_hf.sglang.startup`, on `moba_hf.serving`). The server itself is tested in tests_sglang/ (make test-sglang)."""

import dataclasses
import types

import pytest
import torch
from test_core import spy

from moba_hf import MobaConfig, core
from moba_hf.dca.config import DcaParams
from moba_hf.kernels.dual_chunk import dca_attention
from moba_hf.kernels.rope import default_inv_freq, rotate
from moba_hf.serving import ENV, MobaSetupError, ServedDca
from moba_hf.sglang import startup
from moba_hf.sglang.pool import PoolGateKeys, moba_pool

CONFIG = MobaConfig(block_size=8, top_k=2, decode="moba")
PLAN = core.plan_for(CONFIG, 4)


def token_pool(seq_lens, hkv=2, d=8, seed=0):
    """Keys and values of several sequences in shuffled slots of one pool (slots, Hkv, D) and their
    req_to_token rows (rows 3, 0, 2 of a 4-row table; unused slots NaN)."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(sum(seq_lens) + 5, generator=gen)
    k_buffer = torch.full((len(slots), hkv, d), float("nan"))
    v_buffer = torch.full_like(k_buffer, float("nan"))
    rows = [3, 0, 2]
    req_to_token = torch.zeros(4, max(seq_lens) + 3, dtype=torch.int32)
    keys, values, used = [], [], 0
    for row, n in zip(rows, seq_lens, strict=True):
        mine = slots[used : used + n]
        used += n
        req_to_token[row, :n] = mine.int()
        k, v = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
        k_buffer[mine], v_buffer[mine] = k, v
        keys.append(k), values.append(v)
    return k_buffer, v_buffer, req_to_token, rows, keys, values


@pytest.mark.parametrize("dense", [False, True])
def test_pool_attention_reaches_the_core_and_matches_it(monkeypatch, dense):
    seq_lens, new = [40, 57, 33], [40, 9, 1]  # a prompt, a chunk after a cached prefix, a decode step
    k_buffer, v_buffer, req_to_token, rows, keys, values = token_pool(seq_lens)
    query = torch.randn(sum(new), 4, 8, generator=torch.Generator().manual_seed(1))
    output = torch.full_like(query, float("nan"))
    calls = spy(monkeypatch)
    moba_pool(
        query, output, k_buffer, v_buffer, req_to_token, req_pool_indices=rows, seq_lens=seq_lens, extend_lens=new,
        plan=PLAN, scale=None, dense=dense,
    )  # fmt: skip
    route = "sdpa" if dense else "moba"
    assert calls == [("attend", route)] * 3
    start = 0
    for k, v, nq in zip(keys, values, new, strict=True):
        q = query[start : start + nq].transpose(0, 1)[None]
        expected = core.attend(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], PLAN, None, route)
        got = output[start : start + nq].transpose(0, 1)[None]
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        start += nq


@pytest.mark.parametrize("sparse", [False, True])
def test_pool_dca_attends_at_the_dca_positions(monkeypatch, sparse):
    """What the backend does with DCA (c 32, s 24): SGLang's model rotated the new q / k at their index p, the
    backend moves them by `ServedDca.deltas` (keys before the cache write), the pool holds earlier keys at p mod s;
    every sequence then equals DCA over q / k rotated straight to p mod s (`kernels.dual_chunk`), the core's route
    "dca" (dense) or "dca+moba"."""
    c, s, d = 32, 24, 8
    dca = ServedDca(DcaParams(pretraining_length=c, chunk_size=s), default_inv_freq(d, 1e4))
    config = MobaConfig(block_size=8, top_k=2, sparse=sparse, decode="moba")
    seq_lens, new = [70, 57, 33], [70, 9, 1]  # a prompt, a chunk after a cached prefix, a decode step
    k_buffer, v_buffer, req_to_token, rows, raw_keys, values = token_pool(seq_lens)
    raw_q = torch.randn(sum(new), 4, d, generator=torch.Generator().manual_seed(1))
    starts = [0, 70, 79, 80]
    delta = dca.deltas(starts, seq_lens)
    at_p, p_mod_s = [], []
    for row, keys, n, nq in zip(rows, raw_keys, seq_lens, new, strict=True):
        p = torch.arange(n)[:, None]
        slots = req_to_token[row, :n].long()
        k_buffer[slots[: n - nq]] = rotate(keys[: n - nq], p[: n - nq] % s, dca.inv_freq)  # written by earlier steps
        at_p.append(rotate(keys[n - nq :], p[n - nq :], dca.inv_freq))
        p_mod_s.append(rotate(keys, p % s, dca.inv_freq))
    new_keys = dca.move(torch.cat(at_p), delta)  # the backend's move before SGLang's cache write
    for row, n, nq, start in zip(rows, seq_lens, new, starts[:-1], strict=True):
        k_buffer[req_to_token[row, n - nq : n].long()] = new_keys[start : start + nq]
    positions = torch.cat([torch.arange(n - nq, n) for n, nq in zip(seq_lens, new, strict=True)])[:, None]
    query = dca.move(rotate(raw_q, positions, dca.inv_freq), delta)
    output = torch.full_like(query, float("nan"))
    calls = spy(monkeypatch)
    moba_pool(
        query, output, k_buffer, v_buffer, req_to_token, req_pool_indices=rows, seq_lens=seq_lens, extend_lens=new,
        plan=core.plan_for(config, 4, dca.params), scale=None, dense=not sparse, dca=dca,
    )  # fmt: skip
    route = "dca+moba" if sparse else "dca"
    assert calls == [("attend", route)] * 3  # every sequence is longer than a chunk: decode runs "dca+moba" too
    for i, (n, nq) in enumerate(zip(seq_lens, new, strict=True)):
        q = rotate(raw_q[starts[i] : starts[i] + nq], positions[starts[i] : starts[i] + nq] % s, dca.inv_freq)
        k, v = p_mod_s[i].transpose(0, 1)[None], values[i].transpose(0, 1)[None]
        want = dca_attention(
            q.transpose(0, 1)[None], k, v, pretraining_length=c, chunk_size=s, inv_freq=dca.inv_freq,
            temperature=dca.params.temperature_factor(n), plan=config.plan(nq) if sparse else None,
        )  # fmt: skip
        # q / k moved in float32 (rotation by p, then by delta) vs rotated straight to p mod s: rounding only
        got = output[starts[i] : starts[i] + nq].transpose(0, 1)[None]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pooling", ["mean", "bound"])
def test_sparse_decode_reads_pooled_keys_kept_beside_the_pool(monkeypatch, pooling):
    """Prompts prefilled (in two chunks for one), then decode steps over the pooled keys beside the pool: each
    equals the core's MoBA over the sequence's keys; a second request sharing the first's prefix slots (a
    radix-cache hit, ending mid-block) and a slot freed and reused by another position read right entries."""
    config = dataclasses.replace(CONFIG, pooling=pooling)
    gen = torch.Generator().manual_seed(2)
    hkv, d, n_slots = 2, 8, 200
    k_buffer, v_buffer = torch.randn(n_slots, hkv, d, generator=gen), torch.randn(n_slots, hkv, d, generator=gen)
    req_to_token = torch.zeros(3, 80, dtype=torch.int32)
    free = torch.randperm(n_slots, generator=gen).tolist()
    req_to_token[0, :45] = torch.tensor(free[:45])  # request 0: 45 tokens
    req_to_token[1, :21] = req_to_token[0, :21]  # request 1 shares 21 of them (mid-block: blocks of 8)
    req_to_token[1, 21:50] = torch.tensor(free[45:74])
    gate_keys = PoolGateKeys(k_buffer, config.block_size, config.pooling)
    query = lambda n: torch.randn(n, 4, d, generator=gen)  # noqa: E731
    pool = (k_buffer, v_buffer, req_to_token)

    plan = core.plan_for(config, 4)

    def check(rows, seq_lens, new):
        q = query(sum(new))
        calls = spy(monkeypatch)
        got = run_with(q, pool, rows, seq_lens, new, gate_keys, plan)
        monkeypatch.undo()
        start = 0
        for row, length, nq in zip(rows, seq_lens, new, strict=True):
            slots = req_to_token[row, :length].long()
            k, v = k_buffer[slots].transpose(0, 1)[None], v_buffer[slots].transpose(0, 1)[None]
            expected = core.attend(q[start : start + nq].transpose(0, 1)[None], k, v, plan, None, "moba")
            torch.testing.assert_close(got[start : start + nq].transpose(0, 1)[None], expected, rtol=0, atol=1e-5)
            start += nq
        return calls

    assert check([0], [30], [30]) == [("attend", "moba")]  # request 0's first chunk
    assert check([0], [44], [14]) == [("attend", "moba")]  # its second chunk
    assert check([0], [45], [1]) == [("decode", "moba")]
    assert check([1], [49], [28]) == [("attend", "moba")]  # request 1 after its prefix hit
    assert check([1, 0], [50, 46], [1, 1]) == [("decode", "moba")] * 2
    # request 0 ends; its slots 21.. are freed, one of its block ends (position 31) reused at 7, a block end again
    req_to_token[2, :40] = torch.tensor([*free[74:81], int(req_to_token[0, 31]), *free[81:113]])
    k_buffer[req_to_token[2, :40].long()] = torch.randn(40, hkv, d, generator=gen)
    assert check([2], [39], [39]) == [("attend", "moba")]
    assert check([2, 1], [40, 51], [1, 1]) == [("decode", "moba")] * 2


def run_with(query, pool, rows, seq_lens, new, gate_keys, plan):
    k_buffer, v_buffer, req_to_token = pool
    output = torch.full_like(query, float("nan"))
    moba_pool(
        query, output, k_buffer, v_buffer, req_to_token, req_pool_indices=rows, seq_lens=seq_lens, extend_lens=new,
        plan=plan, scale=None, gate_keys=gate_keys,
    )  # fmt: skip
    return output


def model_config(moba_config=None, overrides=None, architectures=("LlamaForCausalLM",), context_len=4096, **text):
    """An SGLang ModelConfig as far as startup reads it (a small Llama config, 4096 positions)."""
    from transformers import LlamaConfig

    text = {"max_position_embeddings": 4096, **text}
    hf = LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **text)
    hf.architectures = list(architectures)
    if moba_config is not None:
        hf.moba_config = moba_config
    return types.SimpleNamespace(
        hf_config=hf,
        hf_text_config=hf,
        model_override_args=overrides or {},
        dtype=torch.float32,
        context_len=context_len,
    )


def test_config_sources_in_order(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    assert startup.resolve(model_config()) is None  # no config: SGLang's own attention
    checkpoint = model_config({"block_size": 32})
    assert startup.resolve(checkpoint)[0].block_size == 32
    assert startup.resolve(checkpoint)[2] == "the checkpoint's config.json moba_config"
    monkeypatch.setenv(ENV, "training-free")
    assert startup.resolve(checkpoint)[0] == MobaConfig.preset("training-free")
    both = model_config({"block_size": 32}, overrides={"moba_config": {"block_size": 16, "top_k": 2}})
    config, serving, where = startup.resolve(both)
    assert (config.block_size, config.top_k, serving) == (16, 2, {})
    assert where == "--json-model-override-args moba_config"
    file = tmp_path / "server.toml"
    file.write_text("block_size = 128\nkv_cache_dtype = 'fp32'\n")
    monkeypatch.setenv(ENV, str(file))
    config, serving, _ = startup.resolve(checkpoint)
    assert config.block_size == 128 and serving["kv_cache_dtype"] == "float32"


def test_startup_refusals(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    bad = model_config(overrides={"moba_config": {"top_k": 0}})
    with pytest.raises(MobaSetupError, match="bad MoBA config from --json-model-override-args moba_config: top_k"):
        startup.resolve(bad)
    ok = model_config()
    with pytest.raises(MobaSetupError, match="supports LlamaForCausalLM.*this checkpoint is GPT2LMHeadModel"):
        startup.check(model_config(architectures=("GPT2LMHeadModel",)), MobaConfig(), {}, "x", torch.float32)
    with pytest.raises(MobaSetupError, match="KV cache is bfloat16 but the model runs float32"):
        startup.check(ok, MobaConfig(), {}, "x", torch.bfloat16)
    with pytest.raises(MobaSetupError, match="asks for kv_cache_dtype='bf16'.*--dtype bfloat16"):
        startup.check(ok, MobaConfig(), {"kv_cache_dtype": "bf16"}, "x", torch.float32)
    with pytest.raises(MobaSetupError, match="max_context_tokens=1024 but SGLang runs context_len=4096"):
        startup.check(ok, MobaConfig(), {"max_context_tokens": 1024}, "x", torch.float32)
    assert startup.check(ok, MobaConfig(full_attn_layers=1), {}, "x", torch.float32) == frozenset({3})
    assert startup.check(ok, MobaConfig(dca=True), {}, "x", torch.float32) == frozenset()  # DCA is served
    past = model_config(max_position_embeddings=2048)
    with pytest.raises(MobaSetupError, match="context_len=4096 needs RoPE positions up to 4095, .*=2048"):
        startup.check(past, MobaConfig(), {}, "x", torch.float32)


def test_setup_hands_the_backend_its_plan(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    found = startup.setup(model_config({"block_size": 32, "full_attn_layers": 1, "decode": "full"}), torch.float32)
    assert found.plan is core.plan_for(found.config, 4)  # what the backend and the pool read
    assert (found.plan.full_layers, found.plan.block_size, found.plan.decode) == (frozenset({3}), 32, "full")
    dca = startup.setup(model_config({"block_size": 128, "dca": {"pretraining_length": 1024}}), torch.float32)
    assert dca.plan.dca == dca.dca.params and not dca.plan.sparse_decode(0)
    with pytest.raises(MobaSetupError, match="bad MoBA config from the checkpoint's config.json moba_config: "
                       "full_attn_layer_ids contains 4"):  # fmt: skip
        startup.setup(model_config({"full_attn_layer_ids": [4]}), torch.float32)


def test_dca_setup_resolves_as_the_transformers_path_and_refuses_what_it_cannot_serve():
    config = model_config(max_position_embeddings=4096)
    dca = startup.dca_setup(config, MobaConfig(block_size=128, dca={"pretraining_length": 1024}), "x")
    assert (dca.params.pretraining_length, dca.params.chunk_size) == (1024, 896)
    assert startup.dca_setup(config, MobaConfig(), "x") is None
    # Qwen2.5-1M's block alone (dense DCA): c = chunk_size + 1, s = chunk_size - local_size
    qwen = model_config(
        architectures=("Qwen2ForCausalLM",),
        dual_chunk_attention_config={"chunk_size": 1023, "local_size": 127, "original_max_position_embeddings": 1024},
    )
    found = startup.resolve(qwen)
    assert found[2] == "the checkpoint's dual_chunk_attention_config" and not found[0].sparse
    dca = startup.dca_setup(qwen, found[0], found[2])
    assert (dca.params.pretraining_length, dca.params.chunk_size) == (1024, 896)
    scaled = model_config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(MobaSetupError, match="DCA .* in SGLang supports the rope types default, llama3; .* 'linear'"):
        startup.dca_setup(scaled, MobaConfig(dca=True), "x")
    raised = model_config(overrides={"max_position_embeddings": 1024}, max_position_embeddings=1024)
    with pytest.raises(MobaSetupError, match="pretraining_length .* follows max_position_embeddings"):
        startup.dca_setup(raised, MobaConfig(dca=True), "x")
    qwen.hf_text_config.rope_parameters = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}  # fmt: skip
    with pytest.raises(MobaSetupError, match="dual_chunk_attention_config without its rope_scaling.*'llama3'"):
        startup.check(qwen, found[0], {}, found[2], torch.float32)


@pytest.mark.parametrize(
    "device, compiled, message",
    [
        ("xpu:0", False, r"runs on CPU .* and NVIDIA GPUs .*; this server runs on 'xpu' \(xpu:0\)"),
        ("mps", False, "this server runs on 'mps'"),
        ("cpu", True, "drop --enable-torch-compile"),
        ("cuda:0", True, "drop --enable-torch-compile"),
    ],
)
def test_backend_factory_refuses_what_it_cannot_run(device, compiled, message):
    from moba_hf.sglang import create_backend

    runner = types.SimpleNamespace(device=device, server_args=types.SimpleNamespace(enable_torch_compile=compiled))
    with pytest.raises(MobaSetupError, match=message):
        create_backend(runner)
