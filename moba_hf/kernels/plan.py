"""`BlockPlan`: which keys each query sees, validated once and handed to every kernel.

A plan is data, like FlexAttention's `BlockMask`: `MobaConfig.plan` resolves one per config (a prompt's and a
decode step's), `moba_attention` builds one from its keywords, and every backend takes ``(q, k, v, plan, scale)``
and checks nothing the plan guarantees (only its tensors' shapes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from .checks import check_count, check_shapes
from .selection import DEFAULT_GATE, GateOptions


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """The MoBA rule of one call.

    block_size: keys per block (the last block may be shorter)
    top_k:      blocks each query attends, counting its own (1: own block only)
    gate:       pooling, forced sink / local blocks, adaptive budget (`GateOptions`)
    dense_tail: the last n queries attend every earlier key (applied by `attend_plan` and `dca_attention`;
                backends take plans without one)
    """

    block_size: int
    top_k: int
    gate: GateOptions = DEFAULT_GATE
    dense_tail: int = 0

    def __post_init__(self) -> None:
        check_count("block_size", self.block_size, 1)
        check_count("top_k", self.top_k, 1)
        check_count("dense_tail", self.dense_tail, 0)
        if not isinstance(self.gate, GateOptions):
            raise ValueError(f"gate must be a GateOptions, got {type(self.gate).__name__}")
        if self.gate.min_top_k > self.top_k:
            raise ValueError(f"min_top_k must be between 1 and top_k ({self.top_k}), got {self.gate.min_top_k}")

    @classmethod
    def build(cls, block_size: int, top_k: int, *gate: Any, dense_tail: int = 0, **named: Any) -> BlockPlan:
        """A plan from the public arguments: `gate` / `named` are `GateOptions`' fields (pooling, sink_blocks,
        local_blocks, top_p, min_top_k) in order / by name. The one place a `GateOptions` is built from them."""
        return cls(block_size, top_k, GateOptions(*gate, **named), dense_tail)

    @property
    def sparse(self) -> BlockPlan:
        """This plan without its dense tail: what a backend runs."""
        return dataclasses.replace(self, dense_tail=0) if self.dense_tail else self

    def reaches_back(self) -> bool:
        """Whether some query may attend a block before its own (else each query sees its own block only)."""
        return self.top_k > 1 or self.gate.sink_blocks > 0 or self.gate.local_blocks > 0

    def attended_pairs(self, q_length: int, kv_length: int) -> int:
        """Query-key pairs one head attends for the last `q_length` of `kv_length` positions, from the rule alone.

        The rule takes the query's own block (causally), its forced sink / local blocks and the top_k - 1 best
        other earlier blocks, or all earlier blocks when fewer remain: min(c, sink + local + top_k - 1) whole
        blocks before block c (sink and local overlap only when together they cover every earlier block). So the
        count never depends on the gate scores. With `gate.top_p` it is the most a query attends. The last
        `dense_tail` queries attend every key up to themselves."""
        bs, gate = self.block_size, self.gate
        extra = self.top_k - 1 + gate.sink_blocks + gate.local_blocks
        tail = min(self.dense_tail, q_length)
        first, end = kv_length - q_length, kv_length - tail  # the sparse queries' positions
        pairs = (end + 1 + kv_length) * tail // 2  # the tail: p + 1 keys each
        for c in range(first // bs, -(-end // bs)):
            lo, hi = max(first, c * bs) - c * bs, min(end, (c + 1) * bs) - c * bs  # offsets in block c
            pairs += (hi * (hi + 1) - lo * (lo + 1)) // 2 + (hi - lo) * min(c, extra) * bs
        return pairs


class BackendFunction(Protocol):
    """A MoBA backend: q: [B, Hq, Nq, D] the last Nq positions of k, v: [B, Hkv, Nk, D] (Hq % Hkv == 0) ->
    [B, Hq, Nq, D] in q's dtype under `plan` (without a dense tail: `plan.sparse`); `scale` None means
    head_dim ** -0.5. The shared contract is `moba_attention_reference`'s."""

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float | None = None
    ) -> torch.Tensor: ...


def check_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan) -> None:
    """A backend's own checks: the shapes of q, k, v, and no dense tail (`attend_plan` applies one; a backend
    dropping it silently would attend too little)."""
    check_shapes(q, k, v)
    if plan.dense_tail:
        raise ValueError(
            f"a backend runs a plan without a dense tail, got dense_tail={plan.dense_tail}: call "
            "moba_attention / attend_plan, or pass plan.sparse"
        )
