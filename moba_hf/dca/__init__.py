"""Dual Chunk Attention (An et al., ICML 2024): RoPE position remapping that keeps every query-key distance
below the pretraining length, dense or composed with MoBA. See `positions` for the layout.

The transformers glue lives in `moba_hf.dca.hf` (imported by the attention function, not here, so that
`moba_hf.config` can import `DcaConfig` without a cycle).
"""

from .attention import dca_attention, dca_selected_blocks, query_variants
from .config import DcaConfig, DcaParams, resolve
from .positions import query_positions, relative_positions
from .rope import rotate

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
