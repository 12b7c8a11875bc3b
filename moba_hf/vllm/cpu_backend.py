"""The MoBA attention backend for vLLM's V1 engine on CPU: vLLM's CPU backend plus MoBA.

The KV cache layout, the cache writes (`do_kv_cache_update`) and every dense computation are vLLM's own; what
changes is the attention of the tokens MoBA covers (`routing`: what both MoBA backends share, read through
`layouts.cpu_layout` here). Without a MoBA config (see `startup`) every layer is vLLM's CPU backend, unchanged.
"""

from __future__ import annotations

import dataclasses

from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from .layouts import check_cpu_layout, cpu_layout
from .routing import MobaBackendMixin, MobaBuilderMixin, MobaFields, MobaImplMixin

__all__ = [
    "MobaAttentionBackend",
    "MobaAttentionImpl",
    "MobaAttentionMetadata",
    "MobaAttentionMetadataBuilder",
]


@dataclasses.dataclass
class MobaAttentionMetadata(MobaFields, CPUAttentionMetadata):
    pass


class MobaAttentionMetadataBuilder(MobaBuilderMixin, CPUAttentionMetadataBuilder):
    metadata_cls = MobaAttentionMetadata

    def check_layout(self) -> None:
        check_cpu_layout(self.isa, self.dtype, self.block_size, self.head_dim)


class MobaAttentionImpl(MobaImplMixin, CPUAttentionBackendImpl):
    layout = staticmethod(cpu_layout)
    platform = "cpu"


class MobaAttentionBackend(MobaBackendMixin, CPUAttentionBackend):
    """vLLM's CPU attention backend with MoBA for the layers and tokens a MobaConfig makes sparse."""

    impl_cls = MobaAttentionImpl
    builder_cls = MobaAttentionMetadataBuilder
