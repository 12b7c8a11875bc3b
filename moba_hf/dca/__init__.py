"""Dual Chunk Attention (An et al., ICML 2024): RoPE position remapping that keeps every query-key distance
below the pretraining length, dense or composed with MoBA. See `kernels.dual_chunk_positions` for the layout.

The public DCA names in one place, above integration (docs/architecture.md): the tensor math lives in
`moba_hf.kernels` (`dual_chunk`, `dual_chunk_positions`, `rope`), the transformers side in
`moba_hf.integration.rope_remap`, the configuration in `dca/config.py` (below both). Only the configuration
loads with this file, the rest on first use of a name: `moba_hf.config` imports `moba_hf.dca.config`, which
runs this file, without importing torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import DcaConfig, DcaParams

_LAZY = {  # public name -> module that defines it
    "dca_attention": "moba_hf.kernels.dual_chunk",
    "dca_selected_blocks": "moba_hf.kernels.dual_chunk",
    "query_variants": "moba_hf.kernels.dual_chunk",
    "query_positions": "moba_hf.kernels.dual_chunk_positions",
    "relative_positions": "moba_hf.kernels.dual_chunk_positions",
    "rotate": "moba_hf.kernels.rope",
    "resolve": "moba_hf.integration.rope_remap",
}

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
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moba_hf.dca' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
