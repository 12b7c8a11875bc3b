"""Argument checks every public kernel entry shares, and what each backend's hardware takes."""

from __future__ import annotations

import math
import numbers
import os

import torch

from ..options import check_count  # noqa: F401 - the kernels' count check, shared with MobaConfig


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError naming the tensor, its shape and the valid layout unless q: [B, Hq, Nq, D] are the last Nq
    positions of k, v: [B, Hkv, Nk, D] with Hq % Hkv == 0 (the block rule's values are a `BlockPlan`'s)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch (dim 0) and head_dim (dim 3)")
    if q.shape[0] < 1 or q.shape[3] < 1:
        raise ValueError(f"batch (dim 0) and head_dim (dim 3) must be >= 1, got q shape {tuple(q.shape)}")
    hq, hkv = q.shape[1], k.shape[1]
    if hq < 1:  # a result with no heads is never what a model meant (the selection would divide by zero)
        raise ValueError(f"query heads (dim 1) must be >= 1, got q shape {tuple(q.shape)}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    nq, nk = q.shape[2], k.shape[2]
    if nk < 1 or not 1 <= nq <= nk:
        raise ValueError(f"need 1 <= Nq <= Nk (queries are the last Nq keys), got Nq={nq}, Nk={nk}")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: object) -> None:
    """The public entries' input contract: q, k, v floating-point tensors of one dtype on one device, and `scale`
    None or a finite real number > 0 (integer tensors would come back truncated, scale <= 0 as NaN or garbage)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(
                f"{name} must be a floating-point tensor (float16, bfloat16, float32, float64), got {t.dtype}"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if q.device.type == "meta":  # the block selection reads values
        raise ValueError("q, k, v must hold data (the gate reads their values), got meta tensors")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0
    ):
        raise ValueError(f"scale must be None (head_dim ** -0.5) or a finite number > 0, got {scale!r}")
    if scale is not None and gate_dtype(q.dtype) == torch.float32 and scale > _FLOAT32_MAX:
        # scores are computed in float32 there: the scale would be inf, every score inf or NaN
        raise ValueError(
            f"scale must be at most {_FLOAT32_MAX:.6g} (float32's largest value) for {q.dtype} inputs, whose "
            f"scores are computed in float32; got {scale!r}"
        )


_FLOAT32_MAX = torch.finfo(torch.float32).max


_FLOAT32_UNDERFLOW = math.ldexp(1.0, -150)  # a double at or below it rounds to 0 in float32


def scale_underflows(scale: float, dtype: torch.dtype) -> bool:
    """Whether `scale` rounds to 0 in the scores' dtype (float32 unless `dtype` is float64): every score is then 0,
    as in the reference, but kernels that mask by multiplying -inf with the scale turn masked scores into NaN."""
    return dtype != torch.float64 and scale <= _FLOAT32_UNDERFLOW


def effective_block_size(block_size: int, seq_len: int) -> int:
    """A block longer than the sequence is one block of the sequence's length: same result, memory bounded by the
    sequence, not by the parameter (block_size = 10**11 on 8 tokens must not pad 10**11 keys)."""
    return max(1, min(block_size, seq_len))


def num_blocks(seq_len: int, block_size: int) -> int:
    return -(-seq_len // block_size)


def gate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def needs_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether autograd will ask for gradients of an attention over q, k, v."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))


def cuda_or_triton_interpreter(q: torch.Tensor) -> bool:
    """Where the Triton kernels run: CUDA tensors, or any with the interpreter on (TRITON_INTERPRET=1)."""
    return q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


FLEX_CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # FlexAttention's CPU kernel has no float64


def flex_takes(q: torch.Tensor) -> bool:
    """What FlexAttention runs: any tensor off the CPU, CPU tensors of `FLEX_CPU_DTYPES`."""
    return q.device.type != "cpu" or q.dtype in FLEX_CPU_DTYPES


def flash_attn_takes(q: torch.Tensor) -> bool:
    """What flash-attn 2 accepts: CUDA fp16/bf16, head_dim <= 256, an Ampere or newer GPU."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= 256
        and torch.cuda.get_device_capability(q.device)[0] >= 8
    )
