"""moba_hf: MoBA (Mixture of Block Attention) and Dual Chunk Attention for Hugging Face decoder models.

import moba_hf
model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="moba", moba_config="training-free")

Importing the package is cheap: "moba" is registered with transformers the moment transformers' modeling code
loads (at once if it already has), and the public names below load on first use.
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
    "from_pretrained": "moba_hf.integration",
    "moba_attention": "moba_hf.kernels",
    "register": "moba_hf.integration",
    "revert": "moba_hf.integration",
    "track_sparsity": "moba_hf.integration",
}
__all__ = ["__version__", "dca", *sorted(_LAZY)]

_TRIGGER = "transformers.modeling_utils"  # defines PreTrainedModel; AttentionInterface lives beside it


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


def _register() -> None:
    importlib.import_module("moba_hf.integration").register()


class _RegisterAfterTransformers(importlib.abc.MetaPathFinder):
    """Runs `register()` right after transformers' modeling code is executed, whoever imports it first."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _TRIGGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


if _TRIGGER in sys.modules:
    _register()
elif not any(isinstance(f, _RegisterAfterTransformers) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterTransformers())
