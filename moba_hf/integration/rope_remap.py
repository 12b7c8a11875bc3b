"""DCA on the transformers side: its parameters resolved against a model config, and its run inside the "moba"
attention function (works with plain `from_pretrained(..., attn_implementation="moba")`).

transformers rotates q and k at their absolute positions p and appends k to the KV cache before our
attention function runs, and hands us the cache's own key tensor (DynamicCache). So `remap_fresh` moves
the newly written keys, in place, from p to ``j mod s`` with one relative rotation (rotations compose):
every key is rotated exactly once, on the step that writes it, and the cache then holds DCA keys for all
later steps. Queries are moved (out of place) to ``i mod s``; the core (`core.attend`) derives the other two variants.
``i`` and ``j`` count tokens from the start of each sequence, so left padding and packed rows remap
like the unpadded sequence. Caches that return copies (quantized / offloaded-to-copy caches) would lose
the in-place remap: use the default DynamicCache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .. import core
from ..dca.config import DcaConfig, DcaParams, check_block_multiple, check_chunk, default_chunk_size
from ..kernels.rope import rotate
from . import state
from .layout import sequence_spans
from .support import check_dca_rope, family_of, rope_parameters


def model_pretraining_length(model_config: Any) -> int:
    params = rope_parameters(model_config)
    for value in (
        params.get("original_max_position_embeddings"),
        getattr(model_config, "original_max_position_embeddings", None),
        getattr(model_config, "max_position_embeddings", None),
    ):
        if isinstance(value, int) and value > 1:
            return value
    raise ValueError("DCA needs pretraining_length: the model config has no max_position_embeddings; set it")


def qwen_dca_block(model_config: Any) -> DcaConfig | None:
    """Qwen2.5-1M's `dual_chunk_attention_config` mapped to the paper convention (None if absent).

    Qwen / vLLM: keys at j mod (chunk_size - local_size), largest distance chunk_size
    -> c = chunk_size + 1, s = chunk_size - local_size.
    """
    block = getattr(model_config, "dual_chunk_attention_config", None)
    if not isinstance(block, Mapping) or "chunk_size" not in block:
        return None
    chunk, local = int(block["chunk_size"]), int(block.get("local_size", 0))
    return DcaConfig(pretraining_length=chunk + 1, chunk_size=chunk - local)


def resolve(dca: Any, model_config: Any, block_size: int | None = None) -> DcaParams | None:
    """The DCA parameters a model runs with, or None when DCA is off.

    dca: a DcaConfig (on), True (on, defaults), False (off), or None (on only if the checkpoint carries
    Qwen's dual_chunk_attention_config). `block_size`: the MoBA block size when sparse MoBA is on.
    """
    if dca is False:
        return None
    qwen = qwen_dca_block(model_config)
    if dca is None and qwen is None:
        return None
    config = DcaConfig() if dca is None or dca is True else DcaConfig.from_dict(dca)
    check_dca_rope(model_config)  # the rope type, then the model's RoPE code itself
    base = qwen or DcaConfig()
    c = config.pretraining_length or base.pretraining_length or model_pretraining_length(model_config)
    if config.chunk_size is not None:
        s, explicit = config.chunk_size, True
    elif config.local_window is not None:
        s, explicit = c - config.local_window, True
    elif qwen is not None and config.pretraining_length is None:
        s, explicit = qwen.chunk_size, True
    else:
        s, explicit = default_chunk_size(c), False
        if block_size is not None and s >= block_size:
            s -= s % block_size
    check_chunk(c, s)
    if block_size is not None:
        check_block_multiple(s, block_size, c, explicit)
    return DcaParams(pretraining_length=c, chunk_size=s, temperature=config.temperature)


def resolver(model_config: Any) -> core.DcaResolver:
    """`resolve` against `model_config`, as `core.plan_for` asks it: (the config's dca setting, MoBA's block size
    when sparse) -> DCA's parameters or None."""

    def resolve_here(dca: Any, block_size: int | None) -> DcaParams | None:
        return resolve(dca, model_config, block_size)

    return resolve_here


def model_inv_freq(module: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """The RoPE inverse frequencies of the model `module` belongs to (its own rotary class, so rope_scaling
    types linear / llama3 / yarn keep their frequencies; the class `support.check_dca_rope` checked);
    kept beside the module (`state.LayerState`) per device."""
    layer_state = state.of_layer(module)
    cached = layer_state.inv_freq
    if cached is not None and cached.device == device:
        return cached
    layer_state.inv_freq = config_inv_freq(module.config).to(device)
    return layer_state.inv_freq


def config_inv_freq(model_config: Any) -> torch.Tensor:
    """float32 [head_dim / 2]: the RoPE inverse frequencies of the model's own rotary class
    (`resolve` -> `support.check_dca_rope` found it)."""
    return family_of(type(model_config)).rotary(config=model_config).inv_freq.detach().to(torch.float32)


def remap_fresh(
    module: torch.nn.Module,
    params: DcaParams,
    query: torch.Tensor,
    key: torch.Tensor,
    padding_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, core.Dca]:
    """Move the fresh keys (the last Nq of `key`, in place) and the queries to their DCA positions.

    params: `resolve`'s answer for the model; query: [B, Hq, Nq, D], key: [B, Hkv, Nk, D] as transformers hands
    them over (rotated at position_ids); padding_mask: the 2-D mask the "moba" mask function prepared (None: no
    padding). Returns the moved query and the `core.Dca` it attends with.
    """
    b, nq, nk = query.shape[0], query.shape[2], key.shape[2]
    first = nk - nq
    device = query.device
    spans = sequence_spans(padding_mask, b, nq, nk)
    if spans is None:
        rank = torch.arange(first, nk, device=device).expand(b, nq)
        real = torch.ones(b, nq, dtype=torch.bool, device=device)
    else:  # token index within its own sequence; pads stay where they are
        rank = torch.zeros(b, nq, dtype=torch.long, device=device)
        real = torch.zeros(b, nq, dtype=torch.bool, device=device)
        for row, keys in spans:
            fresh = keys >= first
            rank[row, keys[fresh] - first] = torch.arange(keys.numel(), device=device)[fresh]
            real[row, keys[fresh] - first] = True
    if position_ids is not None and position_ids.shape[-1] == nq:
        rope_pos = position_ids.reshape(-1, nq).expand(b, nq).to(device)
    else:  # no position ids: transformers' default arange
        rope_pos = torch.arange(first, nk, device=device).expand(b, nq)
    delta = torch.where(real, rank % params.chunk_size - rope_pos, 0)
    inv_freq = model_inv_freq(module, device)
    if bool(delta.any()):
        delta = delta[:, None, :]  # [B, 1, Nq]
        work = torch.float64 if query.dtype == torch.float64 else torch.float32  # one rounding back to the dtype
        key[:, :, first:] = rotate(key[:, :, first:], delta, inv_freq, work).to(key.dtype)  # the cache's own tensor
        query = rotate(query, delta, inv_freq, work).to(query.dtype)
    return query, core.Dca(params, inv_freq)
