"""sgl_kernel's names that SGLang's CPU path imports, and the one it calls while serving (a torch version)."""

import torch
from stand_in import names, unavailable


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = request i's run of out_cache_loc (the
    runs of all requests one after the other), in place: SGLang's Triton kernel `assign_req_to_token_pool`."""
    used = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        req_to_token[row, start:end] = out_cache_loc[used : used + end - start].to(req_to_token.dtype)
        used += end - start


IMPORTED_ONLY = (  # imported by SGLang's CPU path at import time, never called while serving these models
    "copy_all_layer_kv_cache_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)
__getattr__ = names(
    "sgl_kernel",
    {"assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu}
    | {name: unavailable(f"sgl_kernel.{name}") for name in IMPORTED_ONLY},
)
del assign_req_to_token_pool_cpu  # served (and logged) by __getattr__
