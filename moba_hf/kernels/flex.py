"""MoBA on PyTorch FlexAttention (backend "flex"): a BlockMask from the selection plus a per-token mask_mod.

Sparsity at two levels::

    BlockMask (q tile of 128 x kv tile): a tile is visited if any query of the q tile selected any block under it
    mask_mod  (per token)              : own block causally, or one of the query's own picked blocks

FlexAttention computes only the visited tiles, so the saving depends on how much the queries of one q tile agree
on their blocks (neighbouring queries of a real model often do; independent random queries do not).
On CUDA the kernel is compiled Triton; on CPU it runs under `torch.compile` (C++ codegen, slow to compile: one
static compile per shape, float32 / float16 / bfloat16 only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .checks import FLEX_CPU_DTYPES, effective_block_size, flex_takes, needs_grad, num_blocks
from .nonfinite import all_finite, has_nonfinite, propagate_moba_nonfinite
from .plan import BlockPlan, check_call
from .selection import DEFAULT_GATE, GateOptions, selection_slices
from .torch_impl import moba_attention_torch

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError as err:  # torch < 2.5
    raise ImportError(f"FlexAttention needs torch >= 2.5 ({err})") from err

_Q_TILE = 128
_GATE_ELEMENTS = 1 << 26  # selection (rows x blocks) held at once
_compiled: dict[str, Callable] = {}


def _flex_static(q, k, v, *, block_mask, scale, enable_gqa):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def _flex(device_type: str):
    """flex_attention compiled for a device type (eager flex is a slow debugging path and materializes scores).

    CPU: static shapes, a compile per signature (shapes, block mask layout, the mask's block size and offset).
    Inductor's CPU FlexAttention with the dynamic shapes torch switches to on the second shape returns wrong
    values or fails to compile (torch 2.13, 20 seeded configurations in one process: 3 off by 1.9-3.4, 13
    `CppCompileError`). The wrapper `_flex_static` has its own compile cache, so CPU signatures do not use up
    the GPU's. Past torch's recompile limit (`torch._dynamo.config.recompile_limit`, 8) torch runs it eagerly:
    the same result over materialized scores.
    """
    if device_type not in _compiled:
        compiled = torch.compile(_flex_static, dynamic=False) if device_type == "cpu" else torch.compile(flex_attention)
        _compiled[device_type] = compiled
    return _compiled[device_type]


def _kv_tile(block_size: int) -> int:
    # a MoBA block is one kv tile when it is a multiple of 128; else 128-key tiles (each may hold several blocks)
    return block_size if block_size % 128 == 0 else 128


def _selection(q, k, block_size: int, top_k: int, gate: GateOptions):
    """(picks [B, Hq, Nq, S] int32: earlier blocks each query picked, -1 = none; tiles [B, Hq, n_qtiles, n_kvtiles])."""
    b, hq, nq, _ = q.shape
    nk = k.shape[2]
    nb = num_blocks(nk, block_size)
    kv_tile = _kv_tile(block_size)
    n_kvt = -(-nk // kv_tile)
    slots = max(1, min(nb, top_k - 1 + gate.sink_blocks + gate.local_blocks))
    # block j overlaps kv tile u
    first_key = torch.arange(nb, device=q.device) * block_size
    last_key = (first_key + block_size).clamp(max=nk) - 1
    overlap = (first_key[:, None] // kv_tile <= torch.arange(n_kvt, device=q.device)) & (
        torch.arange(n_kvt, device=q.device) <= last_key[:, None] // kv_tile
    )
    picks, tiles = [], []
    per = max(_Q_TILE, _GATE_ELEMENTS // (b * hq * nb) // _Q_TILE * _Q_TILE)
    for _, sel, earlier in selection_slices(q, k, block_size=block_size, top_k=top_k, gate=gate, slice_rows=per):
        n = sel.shape[2]
        # the selected block ids first (descending key), -1 where fewer than `slots` were picked
        key = torch.where(earlier, torch.arange(nb, device=q.device, dtype=torch.int32), -1)
        picks.append(key.topk(slots, dim=-1).values)
        pad = -n % _Q_TILE
        sel_t = torch.nn.functional.pad(sel, (0, 0, 0, pad)).unflatten(2, (-1, _Q_TILE)).any(dim=3)
        tiles.append((sel_t.to(torch.float32) @ overlap.to(torch.float32)) > 0)
    return torch.cat(picks, dim=2), torch.cat(tiles, dim=2)


def _mask_mod(picks: torch.Tensor, block_size: int, offset: int, top_k: int):
    slots = picks.shape[-1]

    def mask_mod(b, h, q_idx, kv_idx):
        pos = q_idx + offset
        blk = kv_idx // block_size
        keep = blk == pos // block_size
        for s in range(slots):
            keep = keep | (picks[b, h, q_idx, s] == blk)
        return keep & (kv_idx <= pos)

    mask_mod.__name__ = f"moba_block{block_size}_top{top_k}"
    return mask_mod


def moba_block_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    gate: GateOptions = DEFAULT_GATE,
    whole_tiles: bool = False,
) -> BlockMask:
    """The FlexAttention BlockMask of MoBA for these queries and keys (queries = the last Nq positions).
    whole_tiles: for queries and keys padded at the end to whole tiles (`_flex_cpu`)."""
    b, hq, nq, _ = q.shape
    nk = k.shape[2]
    picks, tiles = _selection(q, k, block_size, top_k, gate)
    kv_num = tiles.sum(dim=-1, dtype=torch.int32)
    kv_idx = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    lengths = (nq, nk)
    if whole_tiles:  # padded queries pick nothing; padded keys lie after every real query (masked causally)
        picks = torch.nn.functional.pad(picks, (0, 0, 0, -nq % _Q_TILE), value=-1)
        lengths = (nq + -nq % _Q_TILE, nk + -nk % _kv_tile(block_size))
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        BLOCK_SIZE=(_Q_TILE, _kv_tile(block_size)),
        mask_mod=_mask_mod(picks, block_size, nk - nq, top_k),
        seq_lengths=lengths,
    )


def moba_attention_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float | None = None
) -> torch.Tensor:
    """MoBA attention (same contract as `moba_attention_reference`) with FlexAttention.

    q: [B, Hq, Nq, D]; k, v: [B, Hkv, Nk, D]; returns [B, Hq, Nq, D] in q's dtype; differentiable in q, k, v.
    """
    check_call(q, k, v, plan)
    if not flex_takes(q):  # the registry sends such calls to another backend
        raise ValueError(
            f"backend 'flex' takes CPU tensors in {', '.join(map(str, FLEX_CPU_DTYPES))} only, got {q.dtype}: "
            "use backend 'torch' (or 'auto')"
        )
    if has_nonfinite(q, v):
        return propagate_moba_nonfinite(moba_attention_flex, q, k, v, plan, scale)
    if not all_finite(k):  # compiled FlexAttention (CPU) drops NaN scores: the row would hide the NaN
        return moba_attention_torch(q, k, v, plan, scale)
    if needs_grad(q, k, v) and q.device.type == "cpu":  # the registry sends such calls to another backend
        raise ValueError(
            "backend 'flex' has no CPU backward: use backend 'torch' (or 'auto') when gradients are needed"
        )
    cpu = q.device.type == "cpu"
    with torch.no_grad():
        block_size = effective_block_size(plan.block_size, k.shape[2])  # bounded by the sequence
        mask = moba_block_mask(q, k, block_size=block_size, top_k=plan.top_k, gate=plan.gate, whole_tiles=cpu)
    nq, gqa = q.shape[2], q.shape[1] != k.shape[1]
    if cpu:
        # Inductor's CPU kernel reads whole tiles: past the last query or key it reads memory outside the tensors,
        # and a NaN there turns a masked-out weight of 0 into NaN. Zeros pad both to whole tiles (masked out).
        q_tile, kv_tile = mask.BLOCK_SIZE
        q = torch.nn.functional.pad(q, (0, 0, 0, -nq % q_tile))
        k, v = (torch.nn.functional.pad(t, (0, 0, 0, -t.shape[2] % kv_tile)) for t in (k, v))
    out = _flex(q.device.type)(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    return out[:, :, :nq].to(q.dtype)
