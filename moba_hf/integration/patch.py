"""Switch a loaded model to MoBA and back, and the one-call loader."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import MobaConfig
from .attention import drop_settings
from .cache import install_model_hooks, remove_hooks
from .dca import drop_cached_frequencies
from .dca import resolve as resolve_dca
from .register import NAME, register
from .support import check_supported, family_of

_PREVIOUS = "_moba_previous"  # attribute on the model: (attn_implementation, moba_config) before apply()

ConfigLike = MobaConfig | Mapping[str, Any] | str | Path | None


def as_moba_config(config: ConfigLike) -> MobaConfig:
    """A MobaConfig from a MobaConfig, a mapping, a preset name or a file path (None: the defaults)."""
    return MobaConfig.from_spec(config)


def apply(model: Any, config: ConfigLike = None) -> Any:
    """Switch a loaded decoder model (see `check_supported`) to MoBA attention with `config`; returns the model.

    With config=None the model keeps the moba_config it already carries (or gets the defaults).
    """
    check_supported(model.config)
    if config is None and getattr(model.config, "moba_config", None) is not None:
        moba = as_moba_config(model.config.moba_config)
    else:
        moba = as_moba_config(config)
    moba.full_layer_set(model.config.num_hidden_layers)  # validates explicit layer ids now, not mid-forward
    resolve_dca(moba.dca, model.config, moba.block_size if moba.sparse else None)  # DCA errors now, too
    register()
    if not hasattr(model, _PREVIOUS):
        setattr(model, _PREVIOUS, (model.config._attn_implementation, getattr(model.config, "moba_config", None)))
    model.config.moba_config = moba.to_dict()
    model.set_attn_implementation(NAME)
    install_model_hooks(model, family_of(type(model.config)).attentions)  # the KV-cache hooks; revert removes them
    return model


def revert(model: Any) -> Any:
    """Restore the attention implementation (and moba_config) the model had before `apply`."""
    if not hasattr(model, _PREVIOUS):
        return model
    implementation, moba_config = getattr(model, _PREVIOUS)
    delattr(model, _PREVIOUS)
    remove_hooks(model)  # the KV-cache hooks apply (or moba attention's first call) installed
    drop_cached_frequencies(model)
    drop_settings(model)
    if moba_config is None:
        if "moba_config" in vars(model.config):
            del model.config.moba_config
    else:
        model.config.moba_config = moba_config
    model.set_attn_implementation(implementation or "sdpa")
    return model


def from_pretrained(name_or_path: str | Path, moba: ConfigLike = None, **kwargs: Any) -> Any:
    """AutoModelForCausalLM.from_pretrained(..., attn_implementation="moba"), with `moba` as the config: a
    MobaConfig, a mapping, a preset name ("training-free") or a file (None: the checkpoint's own moba_config,
    or the defaults)."""
    from transformers import AutoModelForCausalLM

    register()
    kwargs.setdefault("attn_implementation", NAME)
    if moba is not None and kwargs["attn_implementation"] != NAME:
        raise ValueError(
            f"moba={moba!r} asks for MoBA but attn_implementation={kwargs['attn_implementation']!r} attends "
            "densely: drop one of them"
        )
    if moba is not None and kwargs.get("moba_config") is not None:
        raise ValueError("give the MoBA config once: moba=... or moba_config=..., not both")
    moba = as_moba_config(moba) if moba is not None else None  # a bad preset or file fails before loading
    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    if kwargs["attn_implementation"] != NAME:
        return model
    return apply(model, moba)
