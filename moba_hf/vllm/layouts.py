"""vLLM's KV cache layouts as the MoBA readers take them, and the one startup check that a layout reads back what
vLLM's own cache write wrote.

Every reader (`paged`) takes one layer's pages as two views in one index order, (num_pages, kv_heads, page_size,
head_dim), whatever the strides: a layout function turns a backend's cache tensor into them without a copy. Each
backend names its layout (`MobaImplMixin.layout`) and proves it at startup (`check_layout` through the backend's
own write op, before any request)::

    backend        vLLM's cache of one layer                           layout         check
    CPU            (pages, kv_heads, page, 2 * D): per page and head,  cpu_layout     check_cpu_layout
                   the keys as (D, page), then the values as (page, D)
    Triton (GPU)   logical (pages, kv_heads, page, 2 * D), each        triton_layout  check_triton_layout
                   position's key then its value in the last axis,
                   physical axis order any of vLLM's KVCacheLayouts
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..serving import MobaSetupError
from .paged import gather_sequence

# a backend's cache tensor -> key and value views (num_pages, kv_heads, page_size, head_dim), any strides
Layout = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# writes (tokens, kv_heads, D) keys and values into a scratch cache at the given slots, as the backend does
Write = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def cpu_layout(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU backend: (num_pages, kv_heads, page, 2 * D) holds, per page and head, the keys as (D, page)
    then the values as (page, D)."""
    num_pages, num_kv_heads, page, double = kv_cache.shape
    d = double // 2
    pairs = kv_cache.view(num_pages, num_kv_heads, 2, page * d)
    keys = pairs[:, :, 0].unflatten(-1, (d, page)).transpose(2, 3)
    return keys, pairs[:, :, 1].unflatten(-1, (page, d))


def flash_layout(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's FlashAttention cache: (num_pages, 2, page, kv_heads, D), keys then values."""
    return kv_cache[:, 0].transpose(1, 2), kv_cache[:, 1].transpose(1, 2)


def triton_layout(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's Triton and FlashAttention cache of one layer: logical (num_pages, kv_heads, page, 2 * D), each
    position's key then its value in the last axis, physical order any of vLLM's `KVCacheLayout`s. Viewed as
    (num_pages, 2, page, kv_heads, D), which `flash_layout` reads; no copy."""
    num_pages, kv_heads, page, double = kv_cache.shape
    return flash_layout(kv_cache.unflatten(-1, (2, double // 2)).permute(0, 3, 2, 1, 4))


def check_layout(
    layout: Layout, kv_cache: torch.Tensor, write: Write, *, kv_heads: int, page: int, head_dim: int, refusal: str
) -> None:
    """Refuse (`MobaSetupError` with `refusal`) a layout that does not read back what the backend's own cache
    write put in `kv_cache`, an empty scratch cache of 3 pages of `page` positions: known keys and values of
    (tokens, kv_heads, head_dim), from page 1 on, across a page boundary."""
    device = kv_cache.device
    n = page + page // 2  # crosses a page boundary
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(n, kv_heads, head_dim, generator=gen).to(kv_cache.dtype).to(device) for _ in range(2))
    write(key, value, torch.arange(n, device=device) + page)
    pages = torch.tensor([1, 2], device=device)
    got_k, got_v = (gather_sequence(cache, pages, n) for cache in layout(kv_cache))
    if not (torch.equal(got_k, key.transpose(0, 1)) and torch.equal(got_v, value.transpose(0, 1))):
        raise MobaSetupError(refusal)


def check_cpu_layout(isa: str, dtype: torch.dtype, page: int, head_dim: int) -> None:
    """`cpu_layout` against vLLM's CPU cache write (`cpu_attn_reshape_and_cache`) for this ISA and dtype."""
    from vllm import _custom_ops as ops

    kv_cache = torch.zeros(3, 1, page, 2 * head_dim, dtype=dtype)
    k_view, v_view = kv_cache.view(3, 1, page * 2, head_dim).chunk(2, dim=2)

    def write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        ops.cpu_attn_reshape_and_cache(key, value, k_view, v_view, slots, isa)

    check_layout(
        cpu_layout,
        kv_cache,
        write,
        kv_heads=1,
        page=page,
        head_dim=head_dim,
        refusal=f"moba_hf: vLLM's CPU KV cache layout for isa={isa!r}, dtype={dtype} is not one the MoBA plugin reads "
        "(it reads the 'vec' / 'vec16' layouts: float32 everywhere, 16-bit dtypes without AMX)",
    )


def check_triton_layout(dtype: torch.dtype, page: int, head_dim: int, device: Any, order: tuple[int, ...]) -> None:
    """`triton_layout` against vLLM's Triton cache write (as `TritonAttentionImpl.do_kv_cache_update` calls it)
    into a cache stored in the physical axis order `order` (`KVCacheLayout.layer_view_order`)."""
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

    logical = (3, 2, page, 2 * head_dim)
    kv_cache = torch.zeros([logical[i] for i in order], dtype=dtype, device=device).permute(
        *[order.index(i) for i in range(4)]
    )
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
    one = torch.ones((), device=device)

    def write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        triton_reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", one, one)

    check_layout(
        triton_layout,
        kv_cache,
        write,
        kv_heads=2,
        page=page,
        head_dim=head_dim,
        refusal=f"moba_hf: vLLM's Triton KV cache layout (axis order {order}, dtype={dtype}) is not one the MoBA "
        "plugin reads (keys then values in the last axis of (num_pages, kv_heads, page, 2 * head_dim))",
    )


__all__ = [
    "Layout",
    "check_cpu_layout",
    "check_layout",
    "check_triton_layout",
    "cpu_layout",
    "flash_layout",
    "triton_layout",
]
