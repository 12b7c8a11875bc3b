"""The MoBA attention backend for SGLang on NVIDIA GPUs: SGLang's Triton backend plus MoBA.

As on CPU (`backend.MobaTorchNativeBackend`), the KV pool, its writes and every dense computation are SGLang's own
(its Triton kernels); `backend.MobaPoolMixin` sends the layers and tokens MoBA covers to `pool.moba_pool`, which
reads the pool as one (slots, kv_heads, D) tensor per layer. `check_pool_layout` proves that reading at startup:
SGLang's pool may store another layout (HND pages with SGLANG_USE_HND_KVCACHE, quantized or vectorized caches).

The MoBA path loops over the batch's sequences on the host, so SGLang must not capture CUDA graphs (refused at
startup unless they are off: `create_backend`). Without a MoBA config the backend is SGLang's Triton backend,
unchanged.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from .backend import MobaPoolMixin
from .startup import MobaSetupError, Setup


def check_pool_layout(pool: Any) -> None:
    """Refuse at startup a KV pool `pool.moba_pool` does not read: write known keys and values through the pool's
    own `set_kv_buffer` at slot 0 (SGLang's padding slot) of its first layer, read them back as row 0 of
    `get_key_buffer` / `get_value_buffer` (slots, kv_heads, D), then restore the slot."""
    layer_id = getattr(pool, "start_layer", 0) or 0
    k_buffer, v_buffer = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
    hkv, d, dv = pool.head_num, pool.head_dim, getattr(pool, "v_head_dim", None) or pool.head_dim
    layout = f"{type(pool).__name__} (key buffer {tuple(k_buffer.shape)}, {k_buffer.dtype})"
    if k_buffer.dim() != 3 or tuple(k_buffer.shape[1:]) != (hkv, d) or tuple(v_buffer.shape[1:]) != (hkv, dv):
        raise MobaSetupError(
            f"moba_hf: SGLang's KV pool {layout} is not one the MoBA plugin reads (one (slots, kv_heads={hkv}, "
            f"head_dim={d}) tensor per layer); serve with SGLang's default token pool (no SGLANG_USE_HND_KVCACHE)"
        )
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(1, hkv, d, generator=gen).to(k_buffer.dtype).to(k_buffer.device)
    value = torch.randn(1, hkv, dv, generator=gen).to(v_buffer.dtype).to(v_buffer.device)
    saved = (k_buffer[:1].clone(), v_buffer[:1].clone())
    loc = torch.zeros(1, dtype=torch.int64, device=k_buffer.device)
    layer = types.SimpleNamespace(layer_id=layer_id, k_scale=None, v_scale=None)
    try:
        pool.set_kv_buffer(layer, KVWriteLoc(loc, physical=True), key, value)
        got_k, got_v = pool.get_key_buffer(layer_id)[:1], pool.get_value_buffer(layer_id)[:1]
        same = torch.equal(got_k, key) and torch.equal(got_v, value)
    finally:
        pool.get_key_buffer(layer_id)[:1].copy_(saved[0])
        pool.get_value_buffer(layer_id)[:1].copy_(saved[1])
    if not same:
        raise MobaSetupError(
            f"moba_hf: SGLang's KV pool {layout} does not store a slot's keys and values as row `slot` of its "
            "(slots, kv_heads, head_dim) buffers, which the MoBA plugin reads; serve with SGLang's default token pool"
        )


class MobaTritonBackend(MobaPoolMixin, TritonAttnBackend):
    """SGLang's Triton attention backend with MoBA for the layers and tokens a MobaConfig covers."""

    def __init__(self, model_runner: Any, setup: Setup) -> None:
        super().__init__(model_runner, setup)
        check_pool_layout(self.token_to_kv_pool)


__all__ = ["MobaTritonBackend", "check_pool_layout"]
