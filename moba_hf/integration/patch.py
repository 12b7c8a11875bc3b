"""Switch a loaded model to MoBA and back, and the one-call loader."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import core
from ..config import MobaConfig
from . import state
from .cache import install_model_hooks, remove_hooks
from .register import CONFIG_FIELD, NAME, register
from .rope_remap import resolver
from .support import check_supported, family_of

ConfigLike = MobaConfig | Mapping[str, Any] | str | Path | None


def as_moba_config(config: ConfigLike) -> MobaConfig:
    """A MobaConfig from a MobaConfig, a mapping, a preset name or a file path (None: the defaults)."""
    return MobaConfig.from_spec(config)


def apply(model: Any, config: ConfigLike = None) -> Any:
    """Switch a loaded decoder model (see `check_supported`) to MoBA attention with `config`; returns the model.

    With config=None the model keeps the moba_config it already carries (or gets the defaults). The first `apply`
    on a model records its attention implementation and moba_config for `revert`; later ones switch settings.
    """
    moba = _validate(model, config)  # a bad config changes nothing
    if not state.has_before_apply(model):  # kept beside the model (`state`), never set on it
        had = CONFIG_FIELD in vars(model.config)
        previous = copy.deepcopy(vars(model.config)[CONFIG_FIELD]) if had else None
        state.record_before_apply(model, (model.config._attn_implementation, had, previous))
    return _switch(model, moba)


def _validate(model: Any, config: ConfigLike) -> MobaConfig:
    """The MobaConfig `apply(model, config)` switches to, checked against the model."""
    check_supported(model.config)
    if config is None and getattr(model.config, CONFIG_FIELD, None) is not None:
        moba = as_moba_config(model.config.moba_config)
    else:
        moba = as_moba_config(config)
    # the plan the attention function will resolve: explicit layer ids and DCA fail now, not mid-forward
    core.plan_for(moba, model.config.num_hidden_layers, resolver(model.config))
    return moba


def _switch(model: Any, moba: MobaConfig) -> Any:
    """MoBA with `moba` (from `_validate`), recording nothing for `revert`."""
    register()
    model.config.moba_config = moba.to_dict()
    model.set_attn_implementation(NAME)
    install_model_hooks(model, family_of(type(model.config)).attentions)  # the KV-cache hooks; revert removes them
    return model


def revert(model: Any) -> Any:
    """Restore exactly the attention implementation and moba_config the model had before its first `apply`
    (for a model from `from_pretrained(..., moba=...)` or `attn_implementation="moba"`: the MoBA it loaded with);
    returns the model. A model `apply` never touched (or already reverted) is returned unchanged: revert is
    idempotent, so it can close any block that may have applied. The record is kept beside the model object, not
    on it: a copy of an applied model (deepcopy, torch.load) has none and is returned unchanged. To attend densely
    instead, call `model.set_attn_implementation("sdpa")`."""
    before = state.pop_before_apply(model)
    if before is None:
        return model
    implementation, had, moba_config = before
    remove_hooks(model)  # the KV-cache hooks apply (or moba attention's first call) installed
    state.forget_layers(model)  # resolved configs and DCA frequencies
    if had:
        model.config.moba_config = moba_config
    elif CONFIG_FIELD in vars(model.config):
        del model.config.moba_config  # the class default (None) shows again
    model.set_attn_implementation(implementation or "sdpa")
    if implementation == NAME:
        install_model_hooks(model, family_of(type(model.config)).attentions)
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
    # the MoBA the model comes with, as if loaded with moba_config=...: what `revert` returns to after an `apply`
    return _switch(model, _validate(model, moba))
