"""The "moba" attention function transformers calls for every attention layer.

transformers hands us post-RoPE queries [B, Hq, Nq, D] and the (cache-updated) keys / values
[B, Hkv, Nk, D]; we return [B, Nq, Hq, D]. Hybrid layers run dense causal attention; padded and packed
rows are split into their sequences so blocks never mix tokens of different sequences.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import weakref
from pathlib import Path
from typing import Any

import torch

from .. import core, logs
from ..config import MobaConfig
from ..kernels import resolve_backend
from ..kernels.checks import needs_grad
from . import rope_remap, sparsity, state
from .cache import cached_step
from .layout import is_static_layout, sequence_spans, static_keys
from .support import SUPPORTED_MODEL_TYPES, check_supported  # noqa: F401 - re-exported


@functools.lru_cache(maxsize=64)
def _parse(serialized: str) -> MobaConfig:
    return MobaConfig.from_dict(json.loads(serialized))


def moba_config_of(model_config: Any) -> MobaConfig:
    """The MobaConfig stored in a model's config (defaults, logged once, if there is none).

    A preset name or file path given as `moba_config=` to `from_pretrained` is resolved here once and stored
    back as a dict, so `save_pretrained` writes the values themselves."""
    raw = getattr(model_config, "moba_config", None)
    if raw is None:
        logs.once(
            logging.WARNING,
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


@dataclasses.dataclass(frozen=True, eq=False)
class ResolvedConfig:
    """What the attention function takes from a model config: worked out (and checked) once, then reused by every
    layer and step while the config's attributes still equal `snapshot`, a copy taken after the checks (any
    change to the config, its moba_config or its attention implementation, in place or not, checks again)."""

    config_ref: weakref.ref
    snapshot: dict[str, Any]
    plan: core.AttentionPlan  # which keys each query sees, every layer (`core.plan_for`)

    def holds_for(self, model_config: Any) -> bool:
        if self.config_ref() is not model_config:
            return False
        try:  # one C-level dict comparison; == takes identical values as equal without calling their __eq__
            return _attributes(model_config) == self.snapshot
        except Exception:  # noqa: BLE001 - a new value whose == cannot answer (e.g. a tensor): check again
            return False


def _attributes(model_config: Any) -> dict[str, Any]:
    # the plain __dict__, past the config classes' own (Python-level) attribute lookup
    return object.__getattribute__(model_config, "__dict__")


def _snapshot(attributes: dict[str, Any]) -> dict[str, Any]:
    """A copy of a config's attributes that equals them until one changes: a deep copy of each value, or the value
    itself where its copy does not compare equal to it (an object without ==: then a replacement is seen, an edit
    inside it is not)."""
    snapshot = {}
    for name, value in attributes.items():
        try:
            copied = copy.deepcopy(value)
            same = bool(copied == value)
        except Exception:  # noqa: BLE001 - not copyable, or == gives no single answer (a tensor)
            same = False
        snapshot[name] = copied if same else value
    return snapshot


def resolved_config(module: torch.nn.Module) -> ResolvedConfig:
    """What `module`'s config resolves to: the support check, and the `core.AttentionPlan` of its MobaConfig
    (defaults if it has none: the full-attention layers, DCA's parameters); the checks raise as they would on
    every call.

    Kept beside the module and beside its config (shared by the model's layers), read and written through
    local names only: models forwarded from several threads at once each read their own."""
    model_config = module.config
    layer_state = state.of_layer(module)
    resolved = layer_state.resolved
    if resolved is not None and resolved.holds_for(model_config):
        return resolved
    config_state = state.of_config(model_config)
    resolved = config_state.resolved
    if resolved is None or not resolved.holds_for(model_config):
        resolved = config_state.resolved = _resolve(model_config)
    layer_state.resolved = resolved
    return resolved


def _resolve(model_config: Any) -> ResolvedConfig:
    check_supported(model_config)
    config = moba_config_of(model_config)  # may store a preset's values back into the config: copy after
    plan = core.plan_for(config, model_config.num_hidden_layers, rope_remap.resolver(model_config))
    snapshot = _snapshot(_attributes(model_config))
    return ResolvedConfig(weakref.ref(model_config), snapshot, plan)


# under torch.compile each call runs eagerly (a graph break per layer): the per-sequence work is Python (see docs)
@torch.compiler.disable
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
    plan = resolved_config(module).plan
    if dropout:
        raise ValueError(f"moba attention does not implement attention dropout; got dropout={dropout} (use 0.0)")
    if is_static_layout(attention_mask):  # a pre-allocated cache: attend its written keys only (views, no copy)
        written, attention_mask = static_keys(attention_mask)
        key, value = key[:, :, :written], value[:, :, :written]
    window = kwargs.get("sliding_window")
    if (  # models whose code the support check cannot read (remote code) may still pass options MoBA would ignore
        kwargs.get("softcap") is not None
        or kwargs.get("s_aux") is not None
        or (window is not None and key.shape[2] > window)  # a query sees its last `window` keys: all of them so far
    ):
        _refuse_options(module, key, kwargs)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            "moba attention takes a 2-D padding mask (from attention_mask); got a prepared "
            f"{attention_mask.dim()}-D mask of shape {tuple(attention_mask.shape)}"
        )

    nq, nk = query.shape[2], key.shape[2]
    layer = getattr(module, "layer_idx", None)
    dense = core.runs_dense(plan, nq, plan.dense_layer(layer))
    dca = None
    if plan.dca is not None:  # moves the fresh keys in the cache and the queries to DCA positions
        query, dca = rope_remap.remap_fresh(module, plan.dca, query, key, attention_mask, kwargs.get("position_ids"))

    if not dense and dca is None:  # with a KV cache: keep the block state in step; sparse decode when it applies
        out = cached_step(module, query, key, value, attention_mask, plan, scaling)
        if out is not None:
            return out.transpose(1, 2).contiguous(), None

    spans = sequence_spans(attention_mask, query.shape[0], nq, nk)
    if spans is None:
        out = _attend(query, key, value, plan, scaling, dense, layer, dca)
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
            out[row, :, queries - first_query] = _attend(q, k, v, plan, scaling, dense, layer, dca)[0]
    return out.transpose(1, 2).contiguous(), None


def _refuse_options(module: torch.nn.Module, key: torch.Tensor, kwargs: dict[str, Any]) -> None:
    ignored = {k: kwargs[k] for k in ("softcap", "s_aux") if kwargs.get(k) is not None}
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[2] > window:
        ignored["sliding_window"] = f"{window} (shorter than the {key.shape[2]} keys)"
    raise ValueError(
        f"moba attention cannot honour {', '.join(f'{k}={v}' for k, v in ignored.items())} passed by "
        f"{type(module).__name__}: it needs plain causal full attention"
    )


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: core.AttentionPlan,
    scale: float | None,
    dense: bool,
    layer: int | None,
    dca: core.Dca | None = None,
) -> torch.Tensor:
    route = core.route(dense, k.shape[2], dca)
    if route == "moba":
        backend = functools.partial(resolve_backend, plan.backend, q, needs_grad=needs_grad(q, k, v))
        selection = functools.partial(core.selection, q, k, plan)
        sparsity.record_attention(layer, q, k.shape[2], backend, plan.blocks(q.shape[2]), selection)
    else:  # DCA's gate mixes query variants, but the rule (and so a fixed budget's count) is MoBA's
        blocks = plan.blocks(q.shape[2]) if route == "dca+moba" else None
        selection = functools.partial(core.selection, q, k, plan, dca)
        sparsity.record_attention(layer, q, k.shape[2], route, blocks, selection)
    return core.attend(q, k, v, plan, scale, route, dca)
