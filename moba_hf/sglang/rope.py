"""Plain RoPE in place of SGLang's `DualChunkRotaryEmbedding` under `--attention-backend moba`.

SGLang's Qwen2 layers build `DualChunkRotaryEmbedding` (through `get_rope`) for a checkpoint with a
`dual_chunk_attention_config`: it allocates its tables on CUDA and returns five query variants side by side for
SGLang's `dual_chunk_flash_attn` backend. The plugin runs DCA in its attention backend from plain RoPE q / k (moved
by a position delta, as the transformers path does), so `register` replaces the class through SGLang's hook
registry: with the `moba` backend its constructor builds SGLang's plain `RotaryEmbedding` (the checkpoint's base,
no rope_scaling: `get_rope` passes none with that block, and `startup` refuses a scaled one); with any other
backend it builds SGLang's own class, unchanged. No model file changes.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
from sglang.srt.layers.rotary_embedding.rope_variant import DualChunkRotaryEmbedding

TARGET = "sglang.srt.layers.rotary_embedding.rope_variant.DualChunkRotaryEmbedding"
BACKEND_ARGS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")


def moba_backend() -> bool:
    """Whether this server runs `--attention-backend moba` (for prefill or decode)."""
    from sglang.srt.runtime_context import get_server_args

    from . import NAME

    args = get_server_args()
    return any(getattr(args, name, None) == NAME for name in BACKEND_ARGS)


class PlainRotaryEmbedding(DualChunkRotaryEmbedding):
    """`DualChunkRotaryEmbedding`'s constructor, SGLang's plain `RotaryEmbedding`'s output (with the `moba`
    backend; SGLang's own class otherwise)."""

    @classmethod
    def original(cls) -> type:
        # SGLang's class; read from the bases, since the hook registry rebinds every module's name for it
        return PlainRotaryEmbedding.__bases__[0]

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if not moba_backend():  # an instance of SGLang's class: Python then skips __init__ below
            return cls.original()(*args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: int,
        is_neox_style: bool,
        dtype: torch.dtype,
        chunk_size: int,
        local_size: int,
    ) -> None:
        super(self.original(), self).__init__()  # not SGLang's DCA constructor: it allocates on CUDA
        self.rope = RotaryEmbedding(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)
        self.head_size, self.rotary_dim, self.is_neox_style = head_size, rotary_dim, is_neox_style
        self.chunk_size, self.local_size = chunk_size, local_size

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, offsets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope(positions, query, key, offsets)

    def extra_repr(self) -> str:
        return f"plain RoPE (DCA in the attention backend), chunk_size={self.chunk_size}, local_size={self.local_size}"


__all__ = ["TARGET", "PlainRotaryEmbedding", "moba_backend"]
