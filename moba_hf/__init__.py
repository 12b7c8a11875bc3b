"""moba_hf: MoBA (Mixture of Block Attention) for Hugging Face Llama / Qwen models.

import moba_hf
model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="moba")
"""

from . import dca
from .config import MobaConfig
from .dca import DcaConfig
from .integration import (
    SUPPORTED_MODEL_TYPES,
    apply,
    from_pretrained,
    register,
    revert,
    track_sparsity,
)
from .kernels import causal_attention, moba_attention

__version__ = "0.1.0"

register()

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "DcaConfig",
    "MobaConfig",
    "__version__",
    "apply",
    "causal_attention",
    "dca",
    "from_pretrained",
    "moba_attention",
    "register",
    "revert",
    "track_sparsity",
]
