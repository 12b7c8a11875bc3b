"""Helpers shared by the kernel test files: case ids, random q/k/v for a case, forward plus gradients."""

from __future__ import annotations

import torch


def shape_id(shape) -> str:
    """(B, Hq, Hkv, Nq, Nk, D, block_size, top_k) -> e.g. B2-T63-Q63-H2-HQ4-D16-blk16-k3."""
    b, hq, hkv, nq, nk, d, bs, k = shape
    return f"B{b}-T{nk}-Q{nq}-H{hkv}-HQ{hq}-D{d}-blk{bs}-k{k}"


def gate_id(gate: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in gate.items()) or "mean"


def moba_inputs(shape, dtype=torch.float64, device="cpu", requires_grad=True) -> list[torch.Tensor]:
    b, hq, hkv, nq, nk, d, _, _ = shape
    q = torch.randn(b, hq, nq, d, dtype=dtype, device=device)
    k = torch.randn(b, hkv, nk, d, dtype=dtype, device=device)
    v = torch.randn(b, hkv, nk, d, dtype=dtype, device=device)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def fwd_bwd(fn, q, k, v, grad, **kw):
    """fn's output and its q/k/v gradients for the output gradient `grad`."""
    out = fn(q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))
