"""Rotations of already-rotated RoPE tensors.

RoPE at position p is a rotation by angle p * inv_freq per pair of dims, and rotations compose:
R(a) R(p) x = R(p + a) x. So a query or key transformers rotated at p moves to p + delta with
R(delta); attention scaling factors the model folds into cos / sin (YaRN) are untouched. Angles are
formed in float64 so a move adds no error beyond the model's own rotation. Pairing follows the
Llama / Qwen "rotate_half" layout: dim d pairs with d + head_dim / 2.
"""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(delta: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of delta * inv_freq: delta [...] int -> two [..., head_dim] tensors of `dtype`."""
    angles = delta.to(torch.float64)[..., None] * inv_freq.to(device=delta.device, dtype=torch.float64)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(
    x: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Move x from its RoPE positions by `delta`.

    x: [B, H, N, D] (rotated at some positions); delta: int positions broadcastable to [B, 1, N]
    (e.g. [N] or [B, 1, N]); inv_freq: [D / 2]. Returns x rotated by delta, in `dtype` (default x's), written
    into `out` when given.
    """
    if 2 * inv_freq.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"DCA needs RoPE over the whole head: head_dim {x.shape[-1]} vs {inv_freq.shape[-1]} inverse frequencies"
        )
    dtype = x.dtype if dtype is None else dtype
    cos, sin = rope_cos_sin(delta, inv_freq, dtype)
    xd = x.to(dtype)
    return torch.add(xd * cos, _rotate_half(xd) * sin, out=out)


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """Plain RoPE inverse frequencies, computed the way transformers does (float32)."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
