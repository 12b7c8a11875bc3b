"""What moba_hf keeps beside transformers' objects: tables keyed (weakly) by an attention module or a KV cache.

Nothing is set on the objects themselves, so a model or a cache pickles, saves with `torch.save` and deep-copies
as it would without moba_hf, and an entry goes when its object goes. A copy starts without an entry: its
resolved config, cached frequencies and pooled keys are worked out again on first use.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch


@dataclasses.dataclass(eq=False)
class LayerState:
    """Per attention module."""

    resolved: Any = None  # `attention.ResolvedConfig` of the module's last call
    call: tuple[weakref.ref, bool] | None = None  # during a forward: (the cache, its block state in step)
    hooks: tuple[Any, ...] | None = None  # the forward hook handles `cache.install_hooks` registered
    inv_freq: torch.Tensor | None = None  # the model's RoPE inverse frequencies for DCA, on the last device


@dataclasses.dataclass(eq=False)
class CacheState:
    """Per KV cache."""

    blocks: dict[int, Any] = dataclasses.field(default_factory=dict)  # layer -> `cache.BlockState`
    checked_layers: set[int] = dataclasses.field(default_factory=set)  # layers `check_cache_supported` passed


_layers: weakref.WeakKeyDictionary[torch.nn.Module, LayerState] = weakref.WeakKeyDictionary()
_caches: weakref.WeakKeyDictionary[Any, CacheState] = weakref.WeakKeyDictionary()


def of_layer(module: torch.nn.Module) -> LayerState:
    state = _layers.get(module)
    if state is None:
        state = _layers[module] = LayerState()
    return state


def layer_if_any(module: torch.nn.Module) -> LayerState | None:
    return _layers.get(module)


def of_cache(cache: Any) -> CacheState:
    state = _caches.get(cache)
    if state is None:
        state = _caches[cache] = CacheState()
    return state


def cache_if_any(cache: Any) -> CacheState | None:
    return _caches.get(cache)


def forget_layers(model: torch.nn.Module) -> None:
    """Drop the entries of every module of `model` (used by `revert`, after the hooks are removed)."""
    for module in model.modules():
        _layers.pop(module, None)
