"""The "moba" attention function transformers calls for every attention layer.

transformers hands us post-RoPE queries [B, Hq, Nq, D] and the (cache-updated) keys / values
[B, Hkv, Nk, D]; we return [B, Nq, Hq, D]. Hybrid layers run dense causal attention; padded and packed
rows are split into their sequences so blocks never mix tokens of different sequences.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import weakref
from typing import Any

import torch

from .. import core, logs
from ..config import MobaConfig, MobaSettings
from ..kernels import resolve_backend
from ..kernels.checks import needs_grad
from ..kernels.graph_step import graph_decode_step, graph_dense_step
from . import cache as block_cache
from . import rope_remap, sparsity, state
from .cache import GRAPH_SLOTS, GRAPH_STATS, cached_step, take_call
from .layout import is_static_layout, sequence_spans, static_keys, static_slots
from .support import SUPPORTED_MODEL_TYPES, check_supported  # noqa: F401 - re-exported


@functools.lru_cache(maxsize=64)
def _parse(serialized: str) -> MobaConfig:
    return MobaConfig.from_dict(json.loads(serialized))


def moba_config_of(model_config: Any) -> MobaConfig:
    """The MobaConfig stored in a model's config (defaults, logged once, if there is none).

    Settings stored past `config.MODEL_CONFIG_FIELD` (a preset name, a file path, a plain dict) are resolved here
    once and stored back as read-only values, so `save_pretrained` writes the values themselves."""
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
    if isinstance(raw, MobaSettings):
        return _parse(json.dumps(raw, sort_keys=True))
    # anything else (set before moba_hf was imported, or past the property) is stored anew, read-only, so the
    # resolved config sees every later change (`ResolvedConfig.holds_for`)
    config = MobaConfig.from_spec(raw)
    model_config.moba_config = config.to_dict()
    return config


@dataclasses.dataclass(frozen=True, eq=False)
class ResolvedConfig:
    """What the attention function takes from a model config: worked out (and checked) once, then reused by every
    layer and step until the config's `moba_config` is assigned anew (`model.config.moba_config = ...`,
    `moba_hf.apply`). The stored settings are read-only (`config.MobaSettings`), so no edit goes unseen; the
    model's other fields are read then too, as transformers' modules read them when the model is built."""

    config_ref: weakref.ref
    settings: Any  # the `moba_config` value this was resolved from (compared by identity)
    plan: core.AttentionPlan  # which keys each query sees, every layer (`core.plan_for`)

    def holds_for(self, model_config: Any) -> bool:
        return self.config_ref() is model_config and _settings(model_config) is self.settings


def _settings(model_config: Any) -> Any:
    # the stored value itself, past the config classes' own (Python-level) attribute lookup
    return object.__getattribute__(model_config, "__dict__").get("moba_config")


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
    config = moba_config_of(model_config)  # may store a preset's values back into the config: read after
    plan = core.plan_for(config, model_config.num_hidden_layers, rope_remap.resolver(model_config))
    return ResolvedConfig(weakref.ref(model_config), _settings(model_config), plan)


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
    """transformers' attention function for "moba". The work is Python per sequence, so under torch.compile it is
    opaque to the graph: over a pre-allocated cache (no autograd) one custom op, `moba_hf::attention`, that the graph
    calls like any kernel; otherwise an eager call (a graph break per layer)."""
    if torch.compiler.is_compiling() and is_static_layout(attention_mask) and not needs_grad(query, key, value):
        out = _captured_step(module, query, key, value, attention_mask, scaling, dropout, kwargs)
        if out is None:
            out = _compiled_call(module, query, key, value, attention_mask, scaling, dropout, kwargs)
        return out, None
    return _eager_forward(module, take_call(module), query, key, value, attention_mask, scaling, dropout, kwargs), None


# what the attention call reads of transformers' keyword arguments (the rest are the model's, never attention's)
_OPTIONS = ("position_ids", "sliding_window", "softcap", "s_aux")


def _compiled_call(module, query, key, value, layout, scaling, dropout, kwargs) -> torch.Tensor:
    position_ids, window, softcap, s_aux = (kwargs.get(name) for name in _OPTIONS)
    return torch.ops.moba_hf.attention(
        query, key, value, layout, position_ids, _module_token(module), scaling, dropout, window, softcap, s_aux
    )


def _captured_step(module, query, key, value, layout, scaling, dropout, kwargs) -> torch.Tensor | None:
    """A one-token step over a pre-allocated cache as device ops only (`kernels.graph_step`): what a CUDA graph can
    capture, on `block_cache.GRAPH_STEP_DEVICES`. None where the step takes the op instead: another device, several new
    tokens, options the op refuses, DCA (its remapping reads positions on the host), a sparsity tracker open (it
    counts on the host), or a sparse layer whose block state the op has not built yet (the next step recompiles
    and finds it)."""
    if (
        query.shape[2] != 1
        or query.device.type not in block_cache.GRAPH_STEP_DEVICES
        or dropout
        or sparsity.tracking_anywhere()
    ):
        return None
    if any(kwargs.get(name) is not None for name in _OPTIONS[1:]):  # options the op refuses (position_ids aside)
        return None
    # the settings' identity is an argument: dynamo guards it, so a new moba_config traces the step again
    route = _captured_route(_module_token(module), id(vars(module.config).get("moba_config")))
    if route is None:
        return None
    real, last = static_slots(layout)
    if not isinstance(route, core.BlockPlan):  # "dense"
        out = graph_dense_step(query, key, value, real, last, scaling)
        return out.transpose(1, 2).contiguous()
    stats, slots = getattr(key, GRAPH_STATS, None), getattr(key, GRAPH_SLOTS, None)
    if stats is None:
        return None
    # the statistics must cover the slots before this token: a cache refilled by other code or cropped since would be
    # read wrong (a captured step cannot rebuild them: that reads the host)
    torch._assert_async(slots == last, STALE_STATS)
    out = graph_decode_step(query, key, value, stats, real, last, route, scaling)
    slots.copy_(last + 1)
    return out.transpose(1, 2).contiguous()


STALE_STATS = (
    "moba_hf: a captured decode step found its layer's block statistics behind or ahead of the cache (written by "
    "other code, or cropped, since): one forward of the model over the cache's latest tokens outside the captured "
    "steps (a prompt, several tokens, or an eager step) rebuilds them"
)

# the settings a captured route was worked out for, by identity: kept alive, so that no later settings object takes
# the identity of one a traced step was guarded on
_traced_settings: dict[int, Any] = {}


@torch._dynamo.assume_constant_result
def _captured_route(token: int, settings_id: int) -> core.BlockPlan | str | None:
    """How a captured one-token step of the module numbered `token` attends: "dense", the decode steps' `BlockPlan`
    (sparse), or None (the op). Worked out when the step is traced, from the plan the module's config resolves to
    (settings_id: the identity of its stored settings when traced)."""
    module = state.module_of(token)
    plan = resolved_config(module).plan
    settings = vars(module.config).get("moba_config")
    if id(settings) != settings_id:  # stored anew while resolved (a preset's name): the next step traces again
        return None
    _traced_settings[settings_id] = settings
    if plan.dca is not None:
        return None
    layer = getattr(module, "layer_idx", None)
    if core.runs_dense(plan, 1, plan.dense_layer(layer)):
        return "dense"
    return plan.blocks(1).sparse if plan.sparse_decode(layer) and layer is not None else None


@torch._dynamo.assume_constant_result
def _module_token(module: torch.nn.Module) -> int:
    """The attention module's number for the custom op (which takes no module), worked out when the step is traced
    and kept in the graph as a constant."""
    return state.token_of(module)


# The step's graph holds the op; its body, eager code, keeps the block state and may read tensors on the host, so the
# op is no part of a CUDA graph (inductor splits the graph around it; torch before 2.8 has no such tag).
_NOT_IN_CUDA_GRAPHS = tuple(getattr(torch.Tag, name) for name in ("cudagraph_unsafe",) if hasattr(torch.Tag, name))


@torch.library.custom_op("moba_hf::attention", mutates_args=(), tags=_NOT_IN_CUDA_GRAPHS)
def _attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: torch.Tensor,
    position_ids: torch.Tensor | None,
    token: int,
    scaling: float | None,
    dropout: float,
    sliding_window: int | None,
    softcap: float | None,
    s_aux: torch.Tensor | None,
) -> torch.Tensor:
    module = state.module_of(token)
    values = (position_ids, sliding_window, softcap, s_aux)
    kwargs = {name: v for name, v in zip(_OPTIONS, values, strict=True) if v is not None}
    # no hook ran: the layer's block state is kept beside the pre-allocated keys `key` (`cache.cached_step`)
    return _eager_forward(module, None, query, key, value, layout, scaling, dropout, kwargs)


@_attention_op.register_fake
def _(query, key, value, layout, position_ids, token, scaling, dropout, sliding_window, softcap, s_aux):
    b, hq, nq, d = query.shape
    return query.new_empty(b, nq, hq, d)


@torch.compiler.disable
def _eager_forward(
    module: torch.nn.Module,
    call: tuple[Any, bool] | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """The attention of one call: [B, Nq, Hq, D]. call: `take_call(module)` (None: no hook ran)."""
    plan = resolved_config(module).plan
    if dropout:
        raise ValueError(f"moba attention does not implement attention dropout; got dropout={dropout} (use 0.0)")
    stored = None
    if is_static_layout(attention_mask):  # a pre-allocated cache: attend its written keys only (views, no copy)
        stored = (key, value)
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
        out = cached_step(module, call, stored, query, key, value, attention_mask, plan, scaling)
        if out is not None:
            return out.transpose(1, 2).contiguous()

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
    return out.transpose(1, 2).contiguous()


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
