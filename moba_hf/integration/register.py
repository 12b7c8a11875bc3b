"""Register "moba" with transformers' attention and mask registries."""

from __future__ import annotations

from typing import Any

import torch

from .attention import moba_attention_forward
from .layout import padding_mask_2d

NAME = "moba"


def moba_mask(
    batch_size: int,
    q_length: int | None = None,
    kv_length: int = 0,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask transformers prepares for "moba": the 2-D padding mask [B, kv_length] (None if no padding).

    Causality and block sparsity are the kernel's job, so no [Nq, Nk] mask is ever built.
    """
    cache_position = kwargs.get("cache_position")
    if q_length is None and cache_position is not None:  # older transformers pass the query positions instead
        q_length, q_offset = cache_position.shape[0], int(cache_position[0])
    if isinstance(q_offset, torch.Tensor) or q_offset + q_length != kv_offset + kv_length:
        raise ValueError(
            "moba attention needs the queries to be the newest keys (DynamicCache, the default); "
            "StaticCache / pre-allocated caches are not supported: drop cache_implementation='static'"
        )
    return padding_mask_2d(attention_mask, kv_length, kv_offset)


def register() -> None:
    """Register "moba" with `AttentionInterface` and `AttentionMaskInterface` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, moba_attention_forward)
    AttentionMaskInterface.register(NAME, moba_mask)
