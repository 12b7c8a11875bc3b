"""Plain RoPE in place of vLLM's `DualChunkRotaryEmbedding`.

vLLM's Qwen2 layers build `DualChunkRotaryEmbedding` for a checkpoint with a `dual_chunk_attention_config`:
it was written for vLLM's former DCA backend (five query variants side by side, buffers on CUDA), and no
V1 backend reads its output. The plugin runs DCA in its attention backend from plain RoPE q / k (moved by a
position delta, as the transformers path does), so it registers plain RoPE under that name through vLLM's
out-of-tree custom-op hook; no model file changes.
"""

from __future__ import annotations

import torch
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.rotary_embedding import DualChunkRotaryEmbedding, RotaryEmbedding

NAME = "DualChunkRotaryEmbedding"


class PlainRotaryEmbedding(DualChunkRotaryEmbedding):
    """`DualChunkRotaryEmbedding`'s constructor, vLLM's plain `RotaryEmbedding`'s output."""

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        chunk_size: int,
        local_size: int,
    ) -> None:
        CustomOp.__init__(self)  # not DualChunkRotaryEmbedding's: it allocates on CUDA
        self.rope = RotaryEmbedding(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype)
        self.chunk_size, self.local_size = chunk_size, local_size

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, offsets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope(positions if offsets is None else positions + offsets, query, key)

    forward_cpu = forward_cuda = forward_native

    def extra_repr(self) -> str:
        return f"plain RoPE (DCA in the attention backend), chunk_size={self.chunk_size}, local_size={self.local_size}"


def register() -> None:
    if NAME not in op_registry_oot:  # vLLM may load the plugin more than once per process
        CustomOp.register_oot(PlainRotaryEmbedding, name=NAME)
