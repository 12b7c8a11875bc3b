"""The MoBA attention backend for vLLM's V1 engine on NVIDIA GPUs: vLLM's Triton backend plus MoBA.

As on CPU (`cpu_backend`), the cache layout, the cache writes and every dense computation are vLLM's own (its
Triton kernels); `routing` sends the layers and tokens MoBA covers to `paged.moba_paged`, read through
`layouts.triton_layout`. Without a MoBA config every layer is vLLM's Triton backend, unchanged.

vLLM builds full CUDA graphs of decode steps only when a backend allows them: with a MoBA config this one does
not (`get_cudagraph_support`: the MoBA path loops over the batch's sequences on the host), so vLLM captures
piecewise graphs, with attention and the cache writes run eagerly between them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from . import startup
from .layouts import check_triton_layout, triton_layout
from .routing import MobaBackendMixin, MobaBuilderMixin, MobaFields, MobaImplMixin

__all__ = [
    "MobaTritonAttentionBackend",
    "MobaTritonAttentionImpl",
    "MobaTritonAttentionMetadata",
    "MobaTritonAttentionMetadataBuilder",
]


@dataclasses.dataclass
class MobaTritonAttentionMetadata(MobaFields, TritonAttentionMetadata):
    pass


class MobaTritonAttentionMetadataBuilder(MobaBuilderMixin, TritonAttentionMetadataBuilder):
    metadata_cls = MobaTritonAttentionMetadata

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        if startup.setup(vllm_config) is not None:
            return AttentionCGSupport.NEVER
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)

    def check_layout(self) -> None:
        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        spec = self.kv_cache_spec
        check_triton_layout(spec.dtype, self.block_size, spec.head_size, self.device, layout.layer_view_order)


class MobaTritonAttentionImpl(MobaImplMixin, TritonAttentionImpl):
    layout = staticmethod(triton_layout)
    platform = "cuda"


class MobaTritonAttentionBackend(MobaBackendMixin, TritonAttentionBackend):
    """vLLM's Triton attention backend with MoBA for the layers and tokens a MobaConfig makes sparse."""

    impl_cls = MobaTritonAttentionImpl
    builder_cls = MobaTritonAttentionMetadataBuilder
