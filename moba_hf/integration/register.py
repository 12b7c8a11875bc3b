"""Register "moba" with transformers' attention and mask registries."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from .. import logs
from ..config import MODEL_CONFIG_FIELD
from .attention import moba_attention_forward
from .layout import check_attention_mask, forward_layout, static_layout

NAME = "moba"
CONFIG_FIELD = "moba_config"


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
    """The mask transformers prepares for "moba": the forward's layout, worked out once for every layer (None,
    a 2-D padding mask, or packed documents' ids; see `layout`).

    Causality and block sparsity are the kernel's job, so no [Nq, Nk] mask is ever built.
    """
    cache_position = kwargs.get("cache_position")
    if q_length is None and cache_position is not None:  # older transformers pass the query positions instead
        q_length, q_offset = cache_position.shape[0], int(cache_position[0])
    device = kwargs.get("device")
    # a pre-allocated cache (StaticCache): keys of all kv_length slots, the first q_offset + q_length written. Its
    # length is a tensor once it holds tokens; before, it hands over more slots than keys, with a mask (if any) of
    # the keys only (without a cache kv_length is the mask's width, so a longer mask is refused below)
    written = q_offset + q_length
    if isinstance(q_offset, torch.Tensor) or (
        written < kv_offset + kv_length and (attention_mask is None or attention_mask.shape[-1] == written)
    ):
        return static_layout(attention_mask, batch_size, q_length, kv_length, q_offset, kv_offset, device)
    if attention_mask is not None:  # without a cache kv_length is its length: check it against the queries
        check_attention_mask(attention_mask, batch_size, q_offset + q_length)
    if q_offset + q_length != kv_offset + kv_length:
        raise ValueError(
            f"the forward's {q_length} new tokens after {q_offset} cached ones need {q_offset + q_length} keys; the "
            f"cache holds {kv_offset + kv_length} (a pre-allocated cache: allocate a larger max_cache_len)"
        )
    return forward_layout(attention_mask, mask_function, batch_size, q_length, kv_length, kv_offset, device)


def register() -> None:
    """Register "moba" with `AttentionInterface` and `AttentionMaskInterface` (idempotent), and make
    `moba_config` a known config field, so `from_pretrained(path, attn_implementation="moba",
    moba_config="training-free")` lands in `model.config` like any other config keyword, as the preset's settings
    (`moba_hf.config.MODEL_CONFIG_FIELD`)."""
    from transformers import AttentionInterface, PreTrainedConfig, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, moba_attention_forward)
    AttentionMaskInterface.register(NAME, moba_mask)
    if vars(PreTrainedConfig).get(CONFIG_FIELD) is not MODEL_CONFIG_FIELD:  # None where unset; resolved when set
        setattr(PreTrainedConfig, CONFIG_FIELD, MODEL_CONFIG_FIELD)
    check = getattr(PreTrainedModel, "_check_and_adjust_attn_implementation", None)
    if check is not None and not getattr(check, "_moba_wrapped", False):
        PreTrainedModel._check_and_adjust_attn_implementation = _tell_when_dense(check)


def _tell_when_dense(check: Any) -> Any:
    """Say (once) when a checkpoint that carries a moba_config loads with another attention."""

    @functools.wraps(check)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        chosen = check(self, *args, **kwargs)
        config = getattr(self, "config", None)
        if chosen != NAME and CONFIG_FIELD in getattr(config, "__dict__", {}):
            logs.once(
                logging.WARNING,
                "moba_hf: this checkpoint carries a moba_config but loads with attn_implementation=%r, so it "
                'attends densely; pass attn_implementation="moba" to use MoBA',
                chosen,
            )
        return chosen

    wrapper._moba_wrapped = True
    return wrapper
