"""The GPU backend's startup parts on CPU tensors (no GPU, no server): the KV pool layout check against SGLang's own
token pool (`MHATokenToKVPool`, the pool SGLang's Triton backend writes), and the factory's refusals on CUDA."""

from __future__ import annotations

import os
import types

import pytest
import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # as the servers run: SGLang's CPU paths on import
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool  # noqa: E402

import moba_hf.sglang as plugin  # noqa: E402
from moba_hf import MobaConfig, core  # noqa: E402
from moba_hf.sglang import gpu_backend, startup  # noqa: E402
from moba_hf.sglang.pool import moba_pool  # noqa: E402

HKV, D = 2, 16


def token_pool(page_size: int = 1, size: int = 64) -> MHATokenToKVPool:
    return MHATokenToKVPool(
        size=size, page_size=page_size, dtype=torch.float32, head_num=HKV, head_dim=D, layer_num=2, device="cpu",
        enable_memory_saver=False, enable_alt_stream=False,
    )  # fmt: skip


def test_sglang_token_pool_passes_and_its_padding_slot_is_restored():
    pool = token_pool()
    pool.get_key_buffer(0)[0] = 7.0
    pool.get_value_buffer(0)[0] = -7.0
    gpu_backend.check_pool_layout(pool)
    assert bool((pool.get_key_buffer(0)[0] == 7.0).all()) and bool((pool.get_value_buffer(0)[0] == -7.0).all())


def test_pool_attention_reads_what_sglang_wrote():
    # keys and values written by the pool's own set_kv_buffer at scattered slots, read by moba_pool as the core
    # reads them (the same check test_sglang_host.py makes on a hand-built pool)
    pool = token_pool()
    gen = torch.Generator().manual_seed(0)
    n = 40
    slots = torch.randperm(60, generator=gen)[:n] + 1
    k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
    layer = types.SimpleNamespace(layer_id=1, k_scale=None, v_scale=None)
    pool.set_kv_buffer(layer, KVWriteLoc(slots, physical=True), k, v)
    req_to_token = torch.zeros(2, 64, dtype=torch.int32)
    req_to_token[1, :n] = slots.int()
    plan = core.plan_for(MobaConfig(block_size=8, top_k=2), 2)
    q = torch.randn(n, 4, D, generator=gen)
    out = torch.full_like(q, float("nan"))
    moba_pool(
        q, out, pool.get_key_buffer(1), pool.get_value_buffer(1), req_to_token, req_pool_indices=[1], seq_lens=[n],
        extend_lens=[n], plan=plan, scale=None,
    )  # fmt: skip
    want = core.attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], plan, None, "moba")
    torch.testing.assert_close(out.transpose(0, 1)[None], want, rtol=0, atol=0)


def test_hnd_pool_is_refused(monkeypatch):
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    pool = token_pool(page_size=4)
    with pytest.raises(startup.MobaSetupError, match="KV pool MHATokenToKVPool .* is not one the MoBA plugin reads"):
        gpu_backend.check_pool_layout(pool)


def test_a_pool_storing_slots_elsewhere_is_refused(monkeypatch):
    pool = token_pool()
    keys = pool.get_key_buffer

    monkeypatch.setattr(pool, "get_key_buffer", lambda layer_id: keys(layer_id).roll(1, dims=0))
    with pytest.raises(startup.MobaSetupError, match="does not store a slot's keys and values as row `slot`"):
        gpu_backend.check_pool_layout(pool)


def cuda_runner() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        device="cuda:0", server_args=types.SimpleNamespace(enable_torch_compile=False), model_config=None,
        kv_cache_dtype=torch.float32,
    )  # fmt: skip


def test_cuda_factory_builds_the_triton_backend_and_refuses_cuda_graphs(monkeypatch):
    from sglang.srt.model_executor import cuda_graph_config

    found = startup.Setup(MobaConfig(), core.plan_for(MobaConfig(), 2), "x")
    monkeypatch.setattr(startup, "setup", lambda model_config, cache_dtype: found)
    built = []
    monkeypatch.setattr(gpu_backend, "MobaTritonBackend", lambda runner, setup: built.append(setup) or "triton")
    monkeypatch.setattr(cuda_graph_config, "cuda_graph_fully_disabled", lambda: False)
    with pytest.raises(startup.MobaSetupError, match="runs eagerly .* start SGLang with --disable-cuda-graph"):
        plugin.create_backend(cuda_runner())
    monkeypatch.setattr(cuda_graph_config, "cuda_graph_fully_disabled", lambda: True)
    assert plugin.create_backend(cuda_runner()) == "triton" and built == [found]


def test_rocm_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    with pytest.raises(startup.MobaSetupError, match="this server runs on 'rocm' \\(cuda:0\\)"):
        plugin.create_backend(cuda_runner())
