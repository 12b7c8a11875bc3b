"""Dual Chunk Attention (An et al., ICML 2024): RoPE position remapping that keeps every query-key distance
below the pretraining length, dense or composed with MoBA. See `kernels.dca_positions` for the layout.

The public DCA names in one place. The tensor math lives in `moba_hf.kernels` (`dca`, `dca_positions`, `rope`),
the transformers side in `moba_hf.integration.dca`; `resolve` loads the latter on first use, so that
`moba_hf.config` can import `DcaConfig` from here without importing transformers glue.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..kernels.dca import dca_attention, dca_selected_blocks, query_variants
from ..kernels.dca_positions import query_positions, relative_positions
from ..kernels.rope import rotate
from .config import DcaConfig, DcaParams

__all__ = [
    "DcaConfig",
    "DcaParams",
    "dca_attention",
    "dca_selected_blocks",
    "query_positions",
    "query_variants",
    "relative_positions",
    "resolve",
    "rotate",
]


def __getattr__(name: str) -> Any:
    if name == "resolve":
        return importlib.import_module("moba_hf.integration.dca").resolve
    raise AttributeError(f"module 'moba_hf.dca' has no attribute {name!r}")
