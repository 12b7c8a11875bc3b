"""What moba_hf keeps beside transformers' objects: tables keyed (weakly) by an attention module, a model config
or a KV cache.

Nothing is set on the objects themselves, so a model or a cache pickles, saves with `torch.save` and deep-copies
as it would without moba_hf, and an entry goes when its object goes. A copy starts without an entry: its
resolved config, cached frequencies and pooled keys are worked out again on first use.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref
from typing import Any

import torch


@dataclasses.dataclass(eq=False)
class LayerState:
    """Per attention module."""

    resolved: Any = None  # `attention.ResolvedConfig` of the module's config, this module's own
    hooks: tuple[Any, ...] | None = None  # the forward hook handles `cache.install_hooks` registered
    token: int | None = None  # the module's number in compiled graphs (`token_of`)
    inv_freq: torch.Tensor | None = None  # the model's RoPE inverse frequencies for DCA, on the last device
    _calls: threading.local = dataclasses.field(default_factory=threading.local, repr=False)

    @property
    def call(self) -> tuple[weakref.ref, bool] | None:
        """During a forward: (the cache, its block state in step). Per thread, so one module forwarded from two
        threads at once with two caches reads its own call's cache in each."""
        return getattr(self._calls, "value", None)

    @call.setter
    def call(self, value: tuple[weakref.ref, bool] | None) -> None:
        self._calls.value = value


@dataclasses.dataclass(eq=False)
class CacheState:
    """Per KV cache."""

    blocks: dict[int, Any] = dataclasses.field(default_factory=dict)  # layer -> `cache.BlockState`


@dataclasses.dataclass(eq=False)
class ConfigState:
    """Per model config (shared by the attention modules of one model)."""

    resolved: Any = None  # `attention.ResolvedConfig` of the config as it was when last resolved


class _ByIdentity:
    """A table keyed weakly by object identity: model configs compare by value and cannot be hashed, tensors compare
    element by element, so a WeakKeyDictionary cannot hold them. An entry goes when its object goes."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, obj: Any) -> Any:
        entry = self._entries.get(id(obj))
        return entry[1] if entry is not None and entry[0]() is obj else None

    def setdefault(self, obj: Any, value: Any) -> Any:
        found = self.get(obj)
        if found is not None:
            return found
        key = id(obj)

        def forget(ref: weakref.ref) -> None:
            if self._entries.get(key, (None,))[0] is ref:
                del self._entries[key]

        self._entries[key] = (weakref.ref(obj, forget), value)
        return value


_layers: weakref.WeakKeyDictionary[torch.nn.Module, LayerState] = weakref.WeakKeyDictionary()
_tokens = itertools.count()
_modules_by_token: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
_configs = _ByIdentity()
# keyed by a cache, or by a pre-allocated cache layer's keys tensor (tensors compare by value: kept by identity)
_caches = _ByIdentity()
# per model, what `revert` restores, recorded by its first `apply`: (config._attn_implementation, whether
# config.__dict__ held a moba_config, a copy of that moba_config)
_before_apply: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, bool, Any]] = weakref.WeakKeyDictionary()


def of_layer(module: torch.nn.Module) -> LayerState:
    state = _layers.get(module)
    if state is None:
        state = _layers[module] = LayerState()
    return state


def layer_if_any(module: torch.nn.Module) -> LayerState | None:
    return _layers.get(module)


def token_of(module: torch.nn.Module) -> int:
    """A number for `module`, its own for as long as it lives (never reused): what a compiled graph passes where it
    cannot pass the module (`module_of` reads it back)."""
    layer_state = of_layer(module)
    if layer_state.token is None:
        token = next(_tokens)
        _modules_by_token[token] = module
        layer_state.token = token
    return layer_state.token


def module_of(token: int) -> torch.nn.Module:
    module = _modules_by_token.get(token)
    if module is None:
        raise RuntimeError(f"moba_hf: the attention module of compiled graph token {token} no longer exists")
    return module


def of_config(model_config: Any) -> ConfigState:
    return _configs.get(model_config) or _configs.setdefault(model_config, ConfigState())


def of_cache(cache: Any) -> CacheState:
    return _caches.get(cache) or _caches.setdefault(cache, CacheState())


def cache_if_any(cache: Any) -> CacheState | None:
    return _caches.get(cache)


def forget_layers(model: torch.nn.Module) -> None:
    """Drop the entries of every module of `model` (used by `revert`, after the hooks are removed)."""
    for module in model.modules():
        _layers.pop(module, None)


def record_before_apply(model: torch.nn.Module, before: tuple[Any, bool, Any]) -> None:
    """Keep what `revert` restores, unless the model has a record already (only its first `apply` records)."""
    _before_apply.setdefault(model, before)


def has_before_apply(model: torch.nn.Module) -> bool:
    return model in _before_apply


def pop_before_apply(model: torch.nn.Module) -> tuple[Any, bool, Any] | None:
    """What `revert` restores, taken out of the table (None when `apply` never recorded anything)."""
    return _before_apply.pop(model, None)
