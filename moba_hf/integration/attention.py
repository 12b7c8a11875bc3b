"""The "moba" attention function transformers calls for every attention layer.

transformers hands us post-RoPE queries [B, Hq, Nq, D] and the (cache-updated) keys / values
[B, Hkv, Nk, D]; we return [B, Nq, Hq, D]. Hybrid layers run dense causal attention; padded and packed
rows are split into their sequences so blocks never mix tokens of different sequences.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import torch

from ..config import MobaConfig
from ..kernels import causal_attention, moba_attention, resolve_backend
from ..kernels.common import needs_grad
from . import dca as dca_hf
from . import sparsity
from .cache import DENSE_STEP, cached_step
from .layout import sequence_spans
from .support import SUPPORTED_MODEL_TYPES, check_supported  # noqa: F401 - re-exported

logger = logging.getLogger("moba_hf")

_warned_default: set[int] = set()


@functools.lru_cache(maxsize=64)
def _parse(serialized: str) -> MobaConfig:
    return MobaConfig.from_dict(json.loads(serialized))


def moba_config_of(model_config: Any) -> MobaConfig:
    """The MobaConfig stored in a model's config (defaults, logged once, if there is none).

    A preset name or file path given as `moba_config=` to `from_pretrained` is resolved here once and stored
    back as a dict, so `save_pretrained` writes the settings themselves."""
    raw = getattr(model_config, "moba_config", None)
    if raw is None:
        if id(model_config) not in _warned_default:
            _warned_default.add(id(model_config))
            logger.warning(
                "moba_hf: this checkpoint has no moba_config, so MoBA runs %s, the paper's setting for models "
                "trained with MoBA. For a stock checkpoint use the training-free preset: "
                "from_pretrained(path, attn_implementation='moba', moba_config='training-free') "
                "(moba-hf presets lists them all)",
                MobaConfig(),
            )
        return MobaConfig()
    if isinstance(raw, MobaConfig):
        return raw
    if isinstance(raw, (str, Path)):
        config = MobaConfig.from_spec(raw)
        model_config.moba_config = config.to_dict()
        return config
    return _parse(json.dumps(raw, sort_keys=True))


def moba_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    model_config = module.config
    check_supported(model_config)
    config = moba_config_of(model_config)
    if dropout:
        raise ValueError(f"moba attention does not implement attention dropout; got dropout={dropout} (use 0.0)")
    # models whose code the support check cannot read (remote code) may still pass options MoBA would ignore
    ignored = {k: kwargs[k] for k in ("softcap", "s_aux") if kwargs.get(k) is not None}
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[2] > window:  # a query sees its last `window` keys: all of them up to here
        ignored["sliding_window"] = f"{window} (shorter than the {key.shape[2]} keys)"
    if ignored:
        raise ValueError(
            f"moba attention cannot honour {', '.join(f'{k}={v}' for k, v in ignored.items())} passed by "
            f"{type(module).__name__}: it needs plain causal full attention"
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            "moba attention takes a 2-D padding mask (from attention_mask); got a prepared "
            f"{attention_mask.dim()}-D mask of shape {tuple(attention_mask.shape)}"
        )

    nq, nk = query.shape[2], key.shape[2]
    layer = getattr(module, "layer_idx", None)
    dense = layer is not None and layer in config.full_layer_set(model_config.num_hidden_layers)
    dense = dense or (nq == 1 and config.decode == "full") or not config.sparse
    # Dual Chunk Attention (None when off): moves the fresh keys in the cache and the queries to DCA positions
    query, dca = dca_hf.remap_fresh(module, config, query, key, attention_mask, kwargs.get("position_ids"))

    if not dense and dca is None:  # with a KV cache: keep the block state in step; sparse decode when it applies
        out = cached_step(module, query, key, value, attention_mask, config, scaling)
        if isinstance(out, torch.Tensor):
            return out.transpose(1, 2).contiguous(), None
        dense = out == DENSE_STEP

    spans = sequence_spans(attention_mask, query.shape[0], nq, nk)
    if spans is None:
        out = _attend(query, key, value, config, scaling, dense, layer, dca)
    else:
        out = query.new_zeros(query.shape)  # pad queries get zeros
        first_query = nk - nq
        for row, keys in spans:
            queries = keys[keys >= first_query]
            if queries.numel() == 0:
                continue
            q = query[row : row + 1, :, queries - first_query]
            k = key[row : row + 1, :, keys]
            v = value[row : row + 1, :, keys]
            out[row, :, queries - first_query] = _attend(q, k, v, config, scaling, dense, layer, dca)[0]
    return out.transpose(1, 2).contiguous(), None


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: MobaConfig,
    scale: float | None,
    dense: bool,
    layer: int | None,
    dca: dca_hf.DcaRun | None = None,
) -> torch.Tensor:
    if dca is not None and dca.applies(k.shape[2]):
        return dca.attend(q, k, v, config, scale, dense, layer)
    if dense:
        sparsity.record_attention(layer, q, k.shape[2], "sdpa")
        return causal_attention(q, k, v, scale=scale)
    backend = functools.partial(resolve_backend, config.backend, q, needs_grad=needs_grad(q, k, v))
    sparsity.record_attention(layer, q, k.shape[2], backend, config)
    return moba_attention(q, k, v, scale=scale, backend=config.backend, **config.kernel_kwargs())
