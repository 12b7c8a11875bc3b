"""The MoBA attention backend for vLLM's V1 engine on CPU: vLLM's CPU backend plus MoBA.

The KV cache layout, the cache writes (`do_kv_cache_update`) and every dense computation are vLLM's own; what
changes is the attention of the tokens MoBA covers (`routing`: what both MoBA backends share, read through
`paged.cpu_layout` here). Without a MoBA config (see `startup`) every layer is vLLM's CPU backend, unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from . import startup
from .paged import cpu_layout, gather_sequence
from .routing import MobaBuilderMixin, MobaFields, MobaImplMixin

__all__ = [
    "MobaAttentionBackend",
    "MobaAttentionImpl",
    "MobaAttentionMetadata",
    "MobaAttentionMetadataBuilder",
    "check_cache_layout",
    "cpu_layout",
]


@dataclasses.dataclass
class MobaAttentionMetadata(MobaFields, CPUAttentionMetadata):
    pass


def check_cache_layout(isa: str, dtype: torch.dtype, page: int, head_dim: int) -> None:
    """Refuse at startup a CPU cache layout `cpu_layout` does not read: write known keys and values through
    vLLM's own cache-update op into a two-page scratch cache and read them back."""
    from vllm import _custom_ops as ops

    n = page + page // 2  # crosses a page boundary
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(n, 1, head_dim, generator=gen).to(dtype) for _ in range(2))
    kv_cache = torch.zeros(3, 1, page, 2 * head_dim, dtype=dtype)
    k_view, v_view = kv_cache.view(3, 1, page * 2, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, k_view, v_view, torch.arange(n) + page, isa)
    key_cache, value_cache = cpu_layout(kv_cache)
    pages = torch.tensor([1, 2])
    got_k = gather_sequence(key_cache, pages, n)
    got_v = gather_sequence(value_cache, pages, n)
    if not (torch.equal(got_k, key.transpose(0, 1)) and torch.equal(got_v, value.transpose(0, 1))):
        raise startup.MobaSetupError(
            f"moba_hf: vLLM's CPU KV cache layout for isa={isa!r}, dtype={dtype} is not one the MoBA plugin reads "
            "(it reads the 'vec' / 'vec16' layouts: float32 everywhere, 16-bit dtypes without AMX)"
        )


class MobaAttentionMetadataBuilder(MobaBuilderMixin, CPUAttentionMetadataBuilder):
    metadata_cls = MobaAttentionMetadata

    def check_layout(self) -> None:
        check_cache_layout(self.isa, self.dtype, self.block_size, self.head_dim)


class MobaAttentionImpl(MobaImplMixin, CPUAttentionBackendImpl):
    layout = staticmethod(cpu_layout)
    platform = "cpu"


class MobaAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with MoBA for the layers and tokens a MobaConfig makes sparse."""

    @staticmethod
    def get_impl_cls() -> type[MobaAttentionImpl]:
        return MobaAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[MobaAttentionMetadataBuilder]:
        return MobaAttentionMetadataBuilder
