"""The MoBA attention backend for vLLM's V1 engine on NVIDIA GPUs: vLLM's Triton backend plus MoBA.

As on CPU (`backend`), the cache layout, the cache writes and every dense computation are vLLM's own (its
Triton kernels); `routing` sends the layers and tokens MoBA covers to `paged.moba_paged`, read through
`triton_layout`. Without a MoBA config every layer is vLLM's Triton backend, unchanged.

vLLM builds full CUDA graphs of decode steps only when a backend allows them: with a MoBA config this one does
not (`get_cudagraph_support`: the MoBA path loops over the batch's sequences on the host), so vLLM captures
piecewise graphs, with attention and the cache writes run eagerly between them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from . import startup
from .paged import flash_layout, gather_sequence
from .routing import MobaBuilderMixin, MobaFields, MobaImplMixin

__all__ = [
    "MobaTritonAttentionBackend",
    "MobaTritonAttentionImpl",
    "MobaTritonAttentionMetadata",
    "MobaTritonAttentionMetadataBuilder",
    "check_cache_layout",
    "triton_layout",
]


def triton_layout(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's Triton and FlashAttention cache of one layer: logical (num_pages, kv_heads, page, 2 * D), each
    position's key then its value in the last axis, physical order any of vLLM's `KVCacheLayout`s. Viewed as
    (num_pages, 2, page, kv_heads, D), which `paged.flash_layout` reads; no copy."""
    num_pages, kv_heads, page, double = kv_cache.shape
    return flash_layout(kv_cache.unflatten(-1, (2, double // 2)).permute(0, 3, 2, 1, 4))


def check_cache_layout(dtype: torch.dtype, page: int, head_dim: int, device: Any, order: tuple[int, ...]) -> None:
    """Refuse at startup a cache layout `triton_layout` does not read: write known keys and values through vLLM's
    own Triton cache write (as `TritonAttentionImpl.do_kv_cache_update` calls it) into a three-page scratch cache
    stored in the physical axis order `order` (`KVCacheLayout.layer_view_order`) and read them back."""
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

    n = page + page // 2  # crosses a page boundary
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(n, 2, head_dim, generator=gen).to(dtype).to(device) for _ in range(2))
    logical = (3, 2, page, 2 * head_dim)
    kv_cache = torch.zeros([logical[i] for i in order], dtype=dtype, device=device).permute(
        *[order.index(i) for i in range(4)]
    )
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
    one = torch.ones((), device=device)
    slots = torch.arange(n, device=device) + page
    triton_reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", one, one)
    got_k, got_v = (gather_sequence(c, torch.tensor([1, 2], device=device), n) for c in triton_layout(kv_cache))
    if not (torch.equal(got_k, key.transpose(0, 1)) and torch.equal(got_v, value.transpose(0, 1))):
        raise startup.MobaSetupError(
            f"moba_hf: vLLM's Triton KV cache layout (axis order {order}, dtype={dtype}) is not one the MoBA "
            "plugin reads (keys then values in the last axis of (num_pages, kv_heads, page, 2 * head_dim))"
        )


@dataclasses.dataclass
class MobaTritonAttentionMetadata(MobaFields, TritonAttentionMetadata):
    pass


class MobaTritonAttentionMetadataBuilder(MobaBuilderMixin, TritonAttentionMetadataBuilder):
    metadata_cls = MobaTritonAttentionMetadata

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        if startup.resolve(vllm_config) is not None:
            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)

    def check_layout(self) -> None:
        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        spec = self.kv_cache_spec
        check_cache_layout(spec.dtype, self.block_size, spec.head_size, self.device, layout.layer_view_order)


class MobaTritonAttentionImpl(MobaImplMixin, TritonAttentionImpl):
    layout = staticmethod(triton_layout)
    platform = "cuda"


class MobaTritonAttentionBackend(TritonAttentionBackend):
    """vLLM's Triton attention backend with MoBA for the layers and tokens a MobaConfig makes sparse."""

    @staticmethod
    def get_impl_cls() -> type[MobaTritonAttentionImpl]:
        return MobaTritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[MobaTritonAttentionMetadataBuilder]:
        return MobaTritonAttentionMetadataBuilder
