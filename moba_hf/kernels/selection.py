"""The block gate and its selection, which every MoBA backend goes through.

Block layout for ``Nk`` keys and ``block_size = 4`` (the last block may be partial)::

    keys     0 1 2 3 | 4 5 6 7 | 8 9 10
    block       0    |    1    |   2

Queries are the *last* ``Nq`` positions of the keys: query ``i`` sits at absolute position
``p = Nk - Nq + i`` (prefill: Nq == Nk; decode: Nq == 1). Its current block is ``p // block_size``.

All backends select blocks through `selected_blocks`, so they agree on every tie and rounding of the gate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from ..options import (
    POOLINGS,  # torch-free, shared with moba_hf.config
    check_budget_options,
    check_top_p,
)
from .checks import check_count, effective_block_size, num_blocks
from .pooling import gate_queries, pooled_keys

# up to this many gated picks per query, repeated max passes select instead of topk (the one-query decode step
# takes the same picks from a stable sort)
MAX_PASS_PICKS = 2


@dataclasses.dataclass(frozen=True)
class GateOptions:
    """How the gate scores blocks and which blocks it forces, beyond block_size / top_k (see `MobaConfig`); a
    `BlockPlan` carries one and checks min_top_k against its top_k.

    pooling:      how a block's keys are pooled for its score, one of `POOLINGS`
    sink_blocks:  the first n blocks, always attended
    local_blocks: the n blocks before the query's own, always attended
    top_p:        None: every query takes top_k - 1 gated blocks. A number in (0, 1]: an adaptive budget, each
                  query takes the fewest best-scoring blocks that, with its forced blocks, cover this share of
                  the gate's softmax (score / sqrt(head_dim) over the earlier blocks it may attend), between
                  min_top_k and top_k blocks counting its own (1: the whole mass, the fixed budget)
    min_top_k:    with top_p, the fewest blocks a query attends, counting its own (1 <= min_top_k <= top_k)
    """

    pooling: str = "mean"
    sink_blocks: int = 0
    local_blocks: int = 0
    top_p: float | None = None
    min_top_k: int = 1

    def __post_init__(self) -> None:
        check_count("sink_blocks", self.sink_blocks, 0)
        check_count("local_blocks", self.local_blocks, 0)
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        check_top_p(self.top_p)
        check_count("min_top_k", self.min_top_k, 1)
        check_budget_options(self.top_p, self.min_top_k)


DEFAULT_GATE = GateOptions()  # the paper's gate: mean pooling, no forced blocks


def gate_scores(
    q: torch.Tensor, k: torch.Tensor, block_size: int, pooling: str = "mean", pooled: torch.Tensor | None = None
) -> torch.Tensor:
    """Gate score of every (query, block) pair: [B, Hq, Nq, n_blocks], float32 (float64 for float64 input).

    "mean+max" sums the two scores q.mean(K) + q.max(K); "bound" is Quest's upper bound of q.k. `pooled`:
    `pooled_keys(k, block_size, pooling)` when the caller already has it (query slices of one call share it).
    """
    b, hq, nq, d = q.shape
    hkv = k.shape[1]
    block_size = effective_block_size(block_size, k.shape[2])
    if pooled is None:
        pooled = pooled_keys(k, block_size, pooling)  # [B, Hkv, nb, D or 2D]
    qf = gate_queries(q.to(pooled.dtype).reshape(b, hkv, hq // hkv, nq, d), pooling)
    scores = torch.einsum("bhgqd,bhnd->bhgqn", qf, pooled)
    return scores.reshape(b, hq, nq, -1)


def selected_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    gate: GateOptions = DEFAULT_GATE,
    q_start: int | None = None,
    pooled: torch.Tensor | None = None,
    trim: bool = False,
) -> torch.Tensor:
    """Which blocks each query attends: bool [B, Hq, Nq, n_blocks] (trim: only up to the last query's block).

    True for the query's current block, the forced sink / local blocks before it, and the `top_k - 1`
    earlier blocks with the highest gate score among the rest; never a future block.
    `q_start` is the absolute position of the first query (default: Nk - Nq, the last Nq keys); backends
    that process queries in slices pass it so each slice selects exactly as the whole would, and `pooled`
    (`pooled_keys` of k) so the keys are pooled once.
    """
    nq, nk = q.shape[2], k.shape[2]
    start = nk - nq if q_start is None else q_start
    block_size = effective_block_size(block_size, nk)
    nb = num_blocks(nk, block_size)
    with torch.no_grad():
        current = (torch.arange(nq, device=q.device) + start) // block_size  # [Nq]
        # blocks after the last query's block are never chosen: score only up to it (halves a prefill's gate work)
        seen = (start + nq - 1) // block_size + 1
        if top_k > 1 and pooled is None:
            pooled = pooled_keys(k[:, :, : seen * block_size], block_size, gate.pooling)
        chosen = choose_blocks(
            current,
            seen,
            lambda: gate_scores(q, k, block_size, gate.pooling, pooled[:, :, :seen]),
            batch_heads=(q.shape[0], q.shape[1]),
            top_k=top_k,
            gate=gate,
            first_block=start // block_size,
            head_dim=q.shape[3],
        )
        return chosen if seen == nb or trim else F.pad(chosen, (0, nb - seen))


def block_masks(current: torch.Tensor, n_blocks: int, gate: GateOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """(forced, excluded) bool [..., Nq, n_blocks] for each query's current block (current: [Nq] or [B, 1, Nq]):
    forced = the current block and the sink / local blocks before it (attended without gating); excluded = every
    block that is no gated candidate (forced, or not earlier than the current block)."""
    blk = torch.arange(n_blocks, device=current.device)
    earlier = blk < current[..., None]  # [..., Nq, nb]
    forced = blk == current[..., None]
    if gate.sink_blocks:
        forced = forced | (earlier & (blk < gate.sink_blocks))
    if gate.local_blocks:
        forced = forced | (earlier & (blk >= current[..., None] - gate.local_blocks))
    return forced, ~(earlier & ~forced)


def choose_blocks(
    current: torch.Tensor | None,
    n_blocks: int,
    scores: Callable[[], torch.Tensor],
    *,
    batch_heads: tuple[int, int],
    top_k: int,
    gate: GateOptions,
    first_block: int = 0,
    masks: tuple[torch.Tensor, torch.Tensor] | None = None,
    head_dim: int | None = None,
) -> torch.Tensor:
    """The MoBA selection rule, given each query's current block and its gate scores.

    current: [Nq], or [B, 1, Nq] when batch rows differ (decode over left-padded rows).

    `scores()` returns a new [B, Hq, Nq, n_blocks] tensor (masked in place) and is called only when some block is
    gated (top_k > 1). Returns
    bool [B, Hq, Nq, n_blocks]: the current block, forced sink / local blocks before it, and the top_k - 1
    best-scoring other earlier blocks. Shared by plain MoBA and DCA (whose scores mix query variants);
    `gate.pooling` is already in the scores. first_block: no query's current block is below it (lets the
    exclusion mask skip the columns that are candidates for every row; 0 masks all). masks: `block_masks` of
    these arguments, when the caller keeps them (a decode step's are the same for a whole block of steps; current
    may then be None). head_dim: the queries' head dimension, the softmax temperature of `gate.top_p`.
    """
    forced, excluded = block_masks(current, n_blocks, gate) if masks is None else masks
    selected = forced.expand(*batch_heads, *forced.shape[-2:])
    n_pick = min(top_k - 1, n_blocks)
    if n_pick <= 0:
        return selected if masks is None else selected.clone()  # the caller's kept masks stay untouched
    if gate.top_p is not None and gate.top_p < 1:  # 1 covers the whole mass: the fixed budget, exactly
        if head_dim is None:
            raise ValueError("choose_blocks needs head_dim with top_p (the temperature of the gate's softmax)")
        return selected | top_p_picks(scores(), forced, excluded, n_pick, gate, head_dim)
    # a NaN score (a NaN key pooled into the block, or a NaN query) ranks first, as in torch.max / topk, and its
    # block is picked: the row then attends the NaN and shows it instead of hiding it behind other blocks
    gated = scores()
    # -inf marks the blocks a row may not pick: a candidate scoring -inf (an inf key pooled into it) ranks last
    # among candidates instead, so top_k >= the blocks still attends every earlier block (clamp keeps NaN)
    gated.clamp_(min=torch.finfo(gated.dtype).min)
    # columns between the sink blocks and the first query's local window are candidates for every row: only the
    # columns around them need the mask (a long prefill's slice then masks a few columns, not all of them)
    first = max(0, first_block - gate.local_blocks)
    if gate.sink_blocks:
        gated[..., : gate.sink_blocks].masked_fill_(excluded[..., : gate.sink_blocks], float("-inf"))
    gated[..., first:].masked_fill_(excluded[..., first:], float("-inf"))
    if n_pick <= MAX_PASS_PICKS:  # a max pass per pick beats topk for the paper's top_k = 3 (1.7x on CPU)
        # each pass sets its row's best candidate to -inf; a row out of candidates sets an excluded (-inf) entry
        # again, picking nothing: afterwards the picked blocks are the candidates at -inf
        for _ in range(n_pick):
            gated.scatter_(-1, gated.max(dim=-1, keepdim=True).indices, float("-inf"))
        return selected | (gated.isneginf() & ~excluded)
    top = gated.topk(n_pick, dim=-1, sorted=False)
    picked = torch.zeros_like(gated, dtype=torch.bool).scatter_(-1, top.indices, top.values != float("-inf"))
    return selected | picked


def top_p_picks(
    scores: torch.Tensor,
    forced: torch.Tensor,
    excluded: torch.Tensor,
    n_pick: int,
    gate: GateOptions,
    head_dim: int,
) -> torch.Tensor:
    """The gated picks of the adaptive budget: bool [B, Hq, Nq, n_blocks].

    Candidates are ranked by score as the fixed budget ranks them (a NaN score first; equal scores by block index)
    and taken, best first, while the share of the gate's softmax that the forced blocks and the picks so far cover
    is below `gate.top_p`; at least min_top_k - 1 and at most n_pick of them. Taking the largest shares first is
    what makes the count the fewest that reach top_p. A NaN-scored candidate is always taken (the row then shows
    the NaN, as with a fixed budget) and its share counts as 0; +-inf scores count as the dtype's extremes, so an
    inf-scored block holds the whole mass.
    """
    finite = torch.finfo(scores.dtype)
    nan = scores.isnan()
    logits = scores.nan_to_num(nan=finite.min, posinf=finite.max, neginf=finite.min) * head_dim**-0.5
    # the mass is over the earlier blocks a query may attend (its forced sink / local ones and the candidates):
    # its own block is left out, as its pooled key would hold keys after the query (a prefill pools the whole
    # block, a decode step the keys so far), so the budget stays causal and decode picks what prefill picks
    column = torch.arange(forced.shape[-1], device=forced.device)
    own = column == (forced * column).argmax(dim=-1, keepdim=True)  # the last forced block is the query's own
    earlier_forced = forced & ~own
    logits.masked_fill_(excluded & ~earlier_forced, float("-inf"))
    share = logits.softmax(dim=-1).nan_to_num_(0.0)  # a query in its first block has no earlier block: no mass
    covered = (share * earlier_forced).sum(dim=-1, keepdim=True)
    share.masked_fill_(nan | excluded, 0.0)
    rank_key = scores.clamp(min=finite.min).masked_fill_(nan, float("inf")).masked_fill_(excluded, float("-inf"))
    order = rank_key.argsort(dim=-1, descending=True, stable=True)
    ranked = share.gather(-1, order)
    before = covered + ranked.cumsum(dim=-1) - ranked  # covered before the candidate of each rank is taken
    rank = torch.arange(order.shape[-1], device=order.device)
    take = (rank_key.gather(-1, order) > float("-inf")) & (rank < n_pick)
    take &= (rank < gate.min_top_k - 1) | (before < gate.top_p) | nan.gather(-1, order)
    return torch.zeros_like(take).scatter_(-1, order, take)


def selection_slices(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    gate: GateOptions,
    slice_rows: int,
    trim: bool = False,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """`selected_blocks` over query slices of `slice_rows` (bounds the gate scores held at once).

    Yields (index of the slice's first query, selected [B, Hq, n, n_blocks], earlier = selected minus the own
    block). Fast backends treat the own block (causal) apart from the gated earlier blocks. trim: the last dim
    ends at the slice's last block (later blocks are never selected; half the width of a long prefill's).
    """
    nq, nk = q.shape[2], k.shape[2]
    start = nk - nq
    block_size = effective_block_size(block_size, nk)
    pooled = pooled_keys(k, block_size, gate.pooling) if top_k > 1 else None
    for a in range(0, nq, slice_rows):
        n = min(slice_rows, nq - a)
        selected = selected_blocks(
            q[:, :, a : a + n],
            k,
            block_size=block_size,
            top_k=top_k,
            gate=gate,
            q_start=start + a,
            pooled=pooled,
            trim=trim,
        )
        yield a, selected, without_own_block(selected, start + a, block_size)


def without_own_block(selected: torch.Tensor, first_position: int, block_size: int) -> torch.Tensor:
    """selected [B, Hq, n, m] of the queries at positions first_position.. without each query's own block: the
    gated earlier blocks, which fast backends run apart from the own (causal) block."""
    n, m = selected.shape[2], selected.shape[3]
    own = (torch.arange(n, device=selected.device) + first_position) // block_size
    return selected & (own[:, None] != torch.arange(m, device=selected.device))
