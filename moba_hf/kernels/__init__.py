"""MoBA kernels: one public function, many backends, no transformers import.

Every backend is a function with exactly the signature of `moba_attention_reference`; `moba_attention`
dispatches to one by name. Backends living in optional-dependency modules are imported lazily, and a
missing dependency falls back (one log line) instead of raising ImportError.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable

import torch

from .common import causal_attention, check_inputs, check_moba_args, gate_scores, selected_blocks
from .reference import moba_attention_reference

logger = logging.getLogger("moba_hf")

# name -> "module:function" (lazily imported) ; the reference is always there
_BACKEND_PATHS: dict[str, str] = {
    "reference": "moba_hf.kernels.reference:moba_attention_reference",
    "torch": "moba_hf.kernels.torch_impl:moba_attention_torch",
    "flex": "moba_hf.kernels.flex:moba_attention_flex",
    "triton": "moba_hf.kernels.triton_impl:moba_attention_triton",
    "flash": "moba_hf.kernels.flash:moba_attention_flash",
}
# "auto" tries these in order for each device type; the first importable/applicable one wins
_AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("triton", "flash", "torch", "flex", "reference"),
    "cpu": ("torch", "reference"),
}
_loaded: dict[str, Callable] = {"reference": moba_attention_reference}
_unavailable: dict[str, str] = {}
_warned: set[str] = set()

BACKENDS = ("auto", "reference", "torch", "flex", "triton", "flash")


def register_backend(name: str, path: str) -> None:
    """Make backend `name` available as the function at `path` ("package.module:function")."""
    _BACKEND_PATHS[name] = path
    _loaded.pop(name, None)
    _unavailable.pop(name, None)


def set_auto_order(device_type: str, names: tuple[str, ...]) -> None:
    _AUTO_ORDER[device_type] = tuple(names)


def _load(name: str) -> Callable | None:
    if name in _loaded:
        return _loaded[name]
    if name in _unavailable or name not in _BACKEND_PATHS:
        return None
    module_name, func_name = _BACKEND_PATHS[name].split(":")
    try:
        fn = getattr(importlib.import_module(module_name), func_name)
    except ImportError as err:  # optional dependency missing (triton, flash-attn)
        _unavailable[name] = str(err)
        return None
    _loaded[name] = fn
    return fn


def backend_available(name: str) -> bool:
    return _load(name) is not None


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The concrete backend `moba_attention(..., backend=backend)` runs for query `q`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        for name in _AUTO_ORDER.get(q.device.type, _AUTO_ORDER["cpu"]):
            if _load(name) is not None and _applicable(name, q):
                return name
        return "reference"
    if _load(backend) is None or not _applicable(backend, q, "can_run"):
        # importable but unable to run this input at all (e.g. "triton" on CPU tensors) falls back the same way
        reason = _unavailable.get(backend, f"does not run on {q.device.type} tensors")
        fallback = resolve_backend("auto", q)
        if backend not in _warned:
            _warned.add(backend)
            logger.warning("moba_hf: backend %r unavailable (%s); falling back to %r", backend, reason, fallback)
        return fallback
    return backend


def _applicable(name: str, q: torch.Tensor, predicate: str = "supports") -> bool:
    # optional per-backend predicates (q) -> bool: `supports` says whether "auto" may pick it, `can_run` whether
    # an explicit request can run at all ("flex" does not support CPU for "auto" but can run there when asked)
    check = getattr(_loaded[name], predicate, None)
    return check is None or bool(check(q))


def moba_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    scale: float | None = None,
    backend: str = "auto",
    pooling: str = "mean",
    sink_blocks: int = 0,
    local_blocks: int = 0,
) -> torch.Tensor:
    """Mixture of Block Attention.

    q: (batch, q_heads, Nq, head_dim); k, v: (batch, kv_heads, Nk, head_dim), q_heads % kv_heads == 0,
    Nq <= Nk: the queries are the last Nq key positions. Returns (batch, q_heads, Nq, head_dim), q's dtype.

    Keys are cut into blocks of `block_size`; each query attends its own block causally plus the
    `top_k - 1` earlier blocks with the highest gate score q . pool(K_block) (top_k counts the own block;
    top_k = 1 means own block only; top_k >= number of blocks means plain causal attention).
    `scale` defaults to head_dim ** -0.5 (else a finite number > 0); q, k, v: floating point, one dtype, one device.
    `pooling`, `sink_blocks`, `local_blocks`: see `MobaConfig`.
    """
    check_inputs(q, k, v, scale)
    name = resolve_backend(backend, q)
    logger.debug("moba_attention: backend=%s q=%s k=%s", name, tuple(q.shape), tuple(k.shape))
    return _loaded[name](
        q,
        k,
        v,
        block_size=block_size,
        top_k=top_k,
        scale=scale,
        pooling=pooling,
        sink_blocks=sink_blocks,
        local_blocks=local_blocks,
    )


__all__ = [
    "BACKENDS",
    "backend_available",
    "causal_attention",
    "check_inputs",
    "check_moba_args",
    "gate_scores",
    "moba_attention",
    "moba_attention_reference",
    "register_backend",
    "resolve_backend",
    "selected_blocks",
    "set_auto_order",
]
