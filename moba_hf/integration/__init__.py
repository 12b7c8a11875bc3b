"""The transformers side: registration, the attention function, apply / revert, sparsity tracking."""

from .attention import moba_attention_forward, moba_config_of
from .patch import apply, as_moba_config, from_pretrained, revert
from .register import register
from .sparsity import SparsityStats, track_sparsity
from .support import SUPPORTED_MODEL_TYPES, check_supported

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SparsityStats",
    "apply",
    "as_moba_config",
    "check_supported",
    "from_pretrained",
    "moba_attention_forward",
    "moba_config_of",
    "register",
    "revert",
    "track_sparsity",
]
