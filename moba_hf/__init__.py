"""moba_hf: MoBA (Mixture of Block Attention) and Dual Chunk Attention for Hugging Face decoder models.

import moba_hf
model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="moba", moba_config="training-free")

Importing the package is cheap (neither torch nor transformers loads): the moment transformers' configuration
code executes, `moba_config` becomes a known config field, and the moment its modeling code executes, "moba" is
registered (at once for what is already loaded), so the first `from_pretrained` above works whatever was imported
first. The public names below load on first use.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"

_LAZY = {  # public name -> module that defines it
    "DcaConfig": "moba_hf.dca.config",
    "MobaConfig": "moba_hf.config",
    "SUPPORTED_MODEL_TYPES": "moba_hf.integration",
    "apply": "moba_hf.integration",
    "causal_attention": "moba_hf.kernels",
    "embedded_path": "moba_hf.models",
    "from_pretrained": "moba_hf.models",
    "moba_attention": "moba_hf.kernels",
    "register": "moba_hf.integration",
    "revert": "moba_hf.integration",
    "track_sparsity": "moba_hf.integration",
}
__all__ = ["__version__", "dca", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name == "dca":
        return importlib.import_module("moba_hf.dca")
    raise AttributeError(f"module 'moba_hf' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# transformers' modules that moba_hf completes the moment they execute, whoever imports them and in what order:
# the configuration module (so `moba_config=` is a known config keyword from the very first AutoConfig parse,
# which runs before the modeling code loads) and the modeling module (the attention / mask registries).
_CONFIG_MODULE = "transformers.configuration_utils"
_MODELING_MODULE = "transformers.modeling_utils"
_CONFIG_FIELD = "moba_config"


def _add_config_field(module: Any) -> None:
    """`moba_config` on every model config (`moba_hf.config.MODEL_CONFIG_FIELD`): instances without one read None,
    from_pretrained / AutoConfig keep the `moba_config=` keyword in the config instead of handing it to the
    model's __init__, and whatever is set there is stored as its resolved settings."""
    field = importlib.import_module("moba_hf.config").MODEL_CONFIG_FIELD
    config_cls = module.PreTrainedConfig
    if vars(config_cls).get(_CONFIG_FIELD) is not field:
        setattr(config_cls, _CONFIG_FIELD, field)


def _register(module: Any = None) -> None:
    importlib.import_module("moba_hf.integration").register()


_ON_EXEC = {_CONFIG_MODULE: _add_config_field, _MODELING_MODULE: _register}


class _CompleteTransformers(importlib.abc.MetaPathFinder):
    """Runs `pending[name](module)` right after transformers' module `name` executes (once per name)."""

    def __init__(self, pending: dict[str, Any]) -> None:
        self.pending = pending
        self.finding: set[str] = set()  # the names whose spec the finders behind this one are being asked for

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.pending or fullname in self.finding:
            return None
        self.finding.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.finding.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_complete(module: Any) -> None:
            exec_module(module)
            action = self.pending.pop(fullname, None)
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)
            if action is not None:
                action(module)

        spec.loader.exec_module = exec_then_complete
        return spec


def _install() -> None:
    if any(isinstance(finder, _CompleteTransformers) for finder in sys.meta_path):
        return
    pending = {}
    for name, action in _ON_EXEC.items():  # configuration first: the modeling module imports it
        module = sys.modules.get(name)
        if module is None:
            pending[name] = action
        elif not getattr(module.__spec__, "_initializing", False):  # mid-import (moba_hf imported from inside
            action(module)  # transformers): left to `register()`, which apply / from_pretrained call
    if pending:
        sys.meta_path.insert(0, _CompleteTransformers(pending))


_install()
