"""NaN and inf in attention inputs: the reference's arithmetic, applied on top of kernels that cannot carry it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .checks import effective_block_size, gate_dtype, needs_grad
from .plan import BackendFunction, BlockPlan
from .selection import GateOptions, selected_blocks

# --- NaN / inf inputs ---------------------------------------------------------------------------------------------
# Fused kernels return 0 for a row whose scores are all NaN, and 0 * NaN = NaN spreads a NaN value to rows that
# never attend it. The rule every backend follows instead (the reference's arithmetic): a row with a NaN / inf
# query is NaN; a row attending a NaN value is NaN in that channel, one attending +inf / -inf values is +inf / -inf
# there (NaN for both); NaN / inf keys go through the kernels as they are (masked keys never reach a score).
_HIT_ROWS = 1024


SLICE_ELEMENTS = 1 << 24  # allowed-mask elements per slice while finding the rows that attend a non-finite value


def all_finite(t: torch.Tensor) -> bool:
    """No NaN / inf in t. One sum answers the common case without a bool copy of t; only a non-finite sum (a NaN /
    inf, or huge finite values overflowing) pays for the exact check."""
    return bool(torch.isfinite(t.sum(dtype=gate_dtype(t.dtype)))) or bool(t.isfinite().all())


def has_nonfinite(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether q or v holds a NaN / inf: then backends run `propagate_nonfinite`."""
    return not (all_finite(q) and all_finite(v))


def masked_matmul(probs: torch.Tensor, allowed: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """probs @ v where row i reads only its `allowed` keys: probs, allowed [..., M, N] (allowed broadcastable),
    v [..., N, D] with the same leading dims as probs. Exact for NaN / inf values: each row sums only the values
    it attends, so a non-finite value reaches no other row."""
    if all_finite(v):  # one reduction answers the usual case
        return probs @ v
    bad = ~v.isfinite()
    out = probs @ v.masked_fill(bad, 0)
    m, n, d = probs.shape[-2], probs.shape[-1], v.shape[-1]
    lead = probs.shape[:-2]
    probs3, allowed3 = probs.reshape(-1, m, n), allowed.expand(*lead, m, n).reshape(-1, m, n)
    v3, out3 = v.reshape(-1, n, d), out.reshape(-1, m, d)
    il, ij, idim = bad.reshape(-1, n, d).nonzero(as_tuple=True)
    rows = torch.arange(m, device=v.device)[None, :]
    step = max(1, SLICE_ELEMENTS // m)  # bounds the [entries, M] terms held at once
    for a in range(0, il.numel(), step):
        bl, bj, bd = il[a : a + step], ij[a : a + step], idim[a : a + step]
        term = torch.where(allowed3[bl, :, bj], probs3[bl, :, bj] * v3[bl, bj, bd][:, None], 0)
        out3 = out3.index_put((bl[:, None], rows, bd[:, None]), term, accumulate=True)
    return out3.view(out.shape)


def value_hits(
    v: torch.Tensor, n_heads: int, n_queries: int, allowed: Callable[[int, int, torch.Tensor], torch.Tensor]
) -> torch.Tensor | None:
    """Where rows attend non-finite values: float [B, Hq, Nq, D] holding NaN, +inf or -inf where the row attends
    such values in that channel (NaN for both signs of inf), 0 elsewhere; None if v is finite.

    allowed(a, n, keys): bool [B, Hq, n, len(keys)], whether query rows a .. a + n - 1 attend the key positions
    `keys` (the backend's selection). Only the positions holding a non-finite value are looked at, so a few bad
    values cost O(Nq x their count), not O(Nq x Nk).
    """
    if bool(v.isfinite().all()):
        return None
    b, hkv, nk, d = v.shape
    g = n_heads // hkv
    keys = (~v.isfinite()).any(dim=-1).flatten(0, 1).any(dim=0).nonzero().flatten()  # positions with a bad value
    vk = v[:, :, keys]
    # channels [NaN, +inf, -inf] side by side; a 0/1 matmul counts the attended ones exactly
    ind = torch.cat([vk.isnan(), vk == float("inf"), vk == float("-inf")], dim=-1).to(torch.float32)
    hits = v.new_zeros(b, n_heads, n_queries, d)
    # rows per slice: bounded by the mask's size and by the selection `allowed` computes for them
    rows = max(1, min(_HIT_ROWS, SLICE_ELEMENTS // (b * n_heads * keys.numel())))
    for a in range(0, n_queries, rows):
        n = min(rows, n_queries - a)
        mask = allowed(a, n, keys).to(torch.float32).reshape(b, hkv, g * n, keys.numel())
        count = (mask @ ind).reshape(b, n_heads, n, 3, d) > 0
        nan = count[..., 0, :] | (count[..., 1, :] & count[..., 2, :])
        value = torch.where(count[..., 1, :], float("inf"), torch.where(count[..., 2, :], float("-inf"), 0.0))
        hits[:, :, a : a + n] = value.masked_fill(nan, float("nan")).to(hits.dtype)
    return hits


def moba_allowed(
    q: torch.Tensor, k: torch.Tensor, *, block_size: int, top_k: int, gate: GateOptions
) -> Callable[[int, int, torch.Tensor], torch.Tensor]:
    """`value_hits`' allowed(a, n, keys) for MoBA: the shared selection, causal."""
    nq, nk = q.shape[2], k.shape[2]
    block_size = effective_block_size(block_size, nk)

    def allowed(a: int, n: int, keys: torch.Tensor) -> torch.Tensor:
        sel = selected_blocks(q[:, :, a : a + n], k, block_size=block_size, top_k=top_k, gate=gate, q_start=nk - nq + a)
        q_pos = torch.arange(nk - nq + a, nk - nq + a + n, device=q.device)
        return sel[..., keys // block_size] & (keys[None, :] <= q_pos[:, None])

    return allowed


def propagate_nonfinite(
    attend: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    q: torch.Tensor,
    v: torch.Tensor,
    allowed: Callable[[int, int], torch.Tensor],
) -> torch.Tensor:
    """attend(q, v) -> [B, Hq, Nq, D] run on finite copies of q and v, then the NaN / inf rule above applied on top.

    allowed: as in `value_hits`, computed from the original q (the selection a row made with its NaN query does
    not matter: the row is NaN). Gradients flow through the finite copies: finite rows keep finite gradients.
    """
    q_bad = ~q.isfinite()
    v_bad = ~v.isfinite()
    out = attend(q.masked_fill(q_bad, 0), v.masked_fill(v_bad, 0))
    hits = value_hits(v, q.shape[1], q.shape[2], allowed)
    if hits is not None:
        out = torch.where(hits != 0, hits.to(out.dtype), out)
    return out.masked_fill(q_bad.any(dim=-1, keepdim=True), float("nan"))


class _ValueOf(torch.autograd.Function):
    """y's value with x's gradient (x, y of one shape)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def finite_key_gradients(attend: Callable[[torch.Tensor], torch.Tensor], k: torch.Tensor) -> torch.Tensor:
    """attend(k) with the gradients of attend(k with its NaN / inf entries zeroed), for kernels whose backward
    multiplies a masked score's zero gradient by its key (0 * NaN would reach rows that never saw the key).
    The rows that do see a non-finite key keep their NaN value; their gradients, and the others', stay finite."""
    with torch.no_grad():
        value = attend(k)
    return _ValueOf.apply(attend(k.masked_fill(~k.isfinite(), 0)), value)


def needs_finite_key_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return needs_grad(q, k, v) and not all_finite(k)


def propagate_moba_nonfinite(attend: BackendFunction, q, k, v, plan: BlockPlan, scale) -> torch.Tensor:
    """`propagate_nonfinite` for a backend `attend` under MoBA's selection."""
    allowed = moba_allowed(q, k, block_size=plan.block_size, top_k=plan.top_k, gate=plan.gate)
    return propagate_nonfinite(lambda q_, v_: attend(q_, k, v_, plan, scale), q, v, allowed)


def route_nonfinite(attend: BackendFunction, q, k, v, plan: BlockPlan, scale) -> torch.Tensor | None:
    """For kernels that cannot carry NaN / inf themselves: the result of the backend `attend` with NaN / inf
    propagated exactly as in the reference, or None when the inputs need no such care."""
    if has_nonfinite(q, v):
        return propagate_moba_nonfinite(attend, q, k, v, plan, scale)
    if needs_finite_key_gradients(q, k, v):
        return finite_key_gradients(lambda k_: attend(q, k_, v, plan, scale), k)
    return None
