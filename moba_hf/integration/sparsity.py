"""`track_sparsity()`: count, per layer, the causal query-key pairs MoBA really skipped.

Recording recomputes the (cheap) block gate, so it costs a little time and only while tracking is on.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Callable, Iterator

import torch

from ..kernels.plan import BlockPlan

# trackers open in every thread together (what `tracking_anywhere` reads)
_open_anywhere = 0
_open_lock = threading.Lock()
# the trackers open in this thread (or asyncio task): a forward in another thread records into its own
_active: contextvars.ContextVar[tuple[SparsityStats, ...]] = contextvars.ContextVar("moba_hf_sparsity", default=())


@dataclasses.dataclass
class LayerCount:
    attended: int = 0
    causal: int = 0
    backend: str = ""

    @property
    def sparsity(self) -> float:
        return 1.0 - self.attended / self.causal if self.causal else 0.0


@dataclasses.dataclass(eq=False)  # identity, so nested trackers remove themselves, not an equal sibling
class SparsityStats:
    """Per-layer counts of attended vs causal query-key pairs (summed over batch, heads and calls)."""

    layers: dict[int, LayerCount] = dataclasses.field(default_factory=dict)

    def record(self, layer: int, attended: int, causal: int, backend: str) -> None:
        count = self.layers.setdefault(layer, LayerCount())
        count.attended += attended
        count.causal += causal
        count.backend = backend

    def per_layer(self) -> dict[int, float]:
        """Fraction of causal query-key pairs skipped, per layer (a full-attention layer reports 0)."""
        return {layer: count.sparsity for layer, count in sorted(self.layers.items())}

    @property
    def backends(self) -> dict[int, str]:
        return {layer: count.backend for layer, count in sorted(self.layers.items())}

    @property
    def overall(self) -> float:
        """Skipped fraction over all layers together."""
        causal = sum(c.causal for c in self.layers.values())
        return 1.0 - sum(c.attended for c in self.layers.values()) / causal if causal else 0.0

    def reset(self) -> None:
        self.layers.clear()

    def __str__(self) -> str:
        rows = [
            f"layer {layer:>3}: sparsity {c.sparsity:.3f} ({c.backend})" for layer, c in sorted(self.layers.items())
        ]
        return "\n".join(rows + [f"overall: {self.overall:.3f}"])


@contextlib.contextmanager
def track_sparsity() -> Iterator[SparsityStats]:
    """with moba_hf.track_sparsity() as stats: model(...); print(stats.per_layer())

    Counts the forwards run in the thread (or asyncio task) that opened it, nested trackers each; forwards that
    other threads run meanwhile are theirs alone."""
    global _open_anywhere
    stats = SparsityStats()
    _active.set((*_active.get(), stats))
    with _open_lock:
        _open_anywhere += 1
    try:
        yield stats
    finally:  # by identity: trackers closed in any order remove themselves, not an equal sibling
        _active.set(tuple(open_ for open_ in _active.get() if open_ is not stats))
        with _open_lock:
            _open_anywhere -= 1


def tracking() -> bool:
    return bool(_active.get())


def tracking_anywhere() -> bool:
    """Whether a tracker is open in any thread: a plain number, which a compiled step reads (and guards on) where
    it could not read the context variable."""
    return _open_anywhere > 0


def record(layer: int, attended: int, causal: int, backend: str) -> None:
    for stats in _active.get():
        stats.record(layer, attended, causal, backend)


def record_attention(
    layer: int | None,
    q: torch.Tensor,
    num_keys: int,
    backend: str | Callable[[], str],
    plan: BlockPlan | None = None,
    selection: Callable[[], torch.Tensor] | None = None,
) -> None:
    """Count one prefill attention call of q [B, Hq, Nq, D] over `num_keys` keys, if tracking is on: dense when
    `plan` is None, else the call's MoBA rule, `plan` (`core.AttentionPlan.blocks`): its `attended_pairs` fix
    the count of a fixed budget; an adaptive one (`top_p`) is counted on the blocks `selection()` returns ([B,
    Hq, Nq, n_blocks], asked only while tracking). `backend`: the name to report, or a function giving it
    (likewise)."""
    if not _active.get():
        return
    b, hq, nq = q.shape[:3]
    causal = b * causal_pairs(hq, nq, num_keys)
    attended = causal
    if plan is not None and plan.gate.top_p is not None and plan.gate.top_p < 1:
        if selection is None:
            raise ValueError("an adaptive budget (top_p) is counted on its selection: pass selection=")
        attended = selected_pairs(selection(), num_keys, plan.block_size, plan.dense_tail)
    elif plan is not None:
        attended = b * hq * plan.attended_pairs(nq, num_keys)
    record(layer, attended, causal, backend if isinstance(backend, str) else backend())


def selected_pairs(selected: torch.Tensor, kv_length: int, block_size: int, dense_tail: int = 0) -> int:
    """`attended_pairs` of a selection [B, Hq, Nq, n_blocks] whose last `dense_tail` queries attend every key up
    to themselves instead."""
    nq = selected.shape[2]
    tail = min(dense_tail, nq)
    rows = selected.shape[0] * selected.shape[1]
    first_tail = kv_length - tail  # position of the first tail query
    dense = rows * (first_tail + 1 + kv_length) * tail // 2
    head = attended_pairs(selected[:, :, : nq - tail], first_tail, block_size) if nq > tail else 0
    return head + dense


def causal_pairs(heads: int, q_length: int, kv_length: int) -> int:
    """Query-key pairs a causal attention of the last q_length queries over kv_length keys computes."""
    first = kv_length - q_length + 1
    return heads * (first + kv_length) * q_length // 2


def attended_pairs(selected: torch.Tensor, kv_length: int, block_size: int) -> int:
    """Pairs MoBA attends given the block selection [B, Hq, Nq, n_blocks] (queries are the last Nq keys)."""
    nq, nb = selected.shape[-2], selected.shape[-1]
    q_pos = torch.arange(kv_length - nq, kv_length, device=selected.device)
    block_start = torch.arange(nb, device=selected.device) * block_size
    block_len = torch.clamp(kv_length - block_start, max=block_size)
    # keys of block j visible to the query at p: all of an earlier block, up to p in the own block
    visible = torch.clamp(q_pos[:, None] - block_start[None, :] + 1, min=0)
    visible = torch.minimum(visible, block_len[None, :])
    return int((selected * visible).sum())
