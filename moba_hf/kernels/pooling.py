"""A block's pooled key: how the gate summarizes a block of keys, one rule for every host of the keys.

Pooling reduces per-key features over a block: the sum of the keys ("mean", divided by the count at the end),
their max ("max"), both ("mean+max"), or the max of [k, -k] ("bound": each channel's max and -min). The reduced
form (`BlockStats`) merges by sum / max, so a block's statistics can be kept as keys arrive (the transformers
cache, one row at a time) or per unit of a page (vLLM's paged cache) and turned into the same pooled key.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from ..options import POOLINGS  # torch-free, shared with moba_hf.config
from .checks import effective_block_size, gate_dtype, num_blocks


@dataclasses.dataclass(frozen=True)
class BlockStats:
    """What a pooling keeps of a run of keys, and how runs become a block's pooled key.

    Statistics are [..., width] with width = `gate_width(head_dim, pooling)`: the keys' sum (head_dim channels)
    where the pooling averages ("mean", "mean+max"), then the max of its features where it takes maxima ("max":
    head_dim channels, "bound": 2 * head_dim, "mean+max": head_dim). Runs merge by sum and max, so statistics
    may be kept per block, per unit of a page or per key, and give one pooled key however they were cut.
    """

    pooling: str
    head_dim: int

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")

    @classmethod
    @functools.lru_cache(maxsize=32)
    def of(cls, pooling: str, head_dim: int) -> BlockStats:
        return cls(pooling, head_dim)

    @property
    def sums(self) -> bool:
        return self.pooling in ("mean", "mean+max")

    @property
    def maxes(self) -> bool:
        return self.pooling != "mean"

    @property
    def width(self) -> int:
        return gate_width(self.head_dim, self.pooling)

    @property
    def max_start(self) -> int:
        """Where the maxima start in the statistics (after the sums, if any)."""
        return self.head_dim if self.sums else 0

    def empty(self, *shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """Statistics of no keys, [*shape, width]: zero sums, -inf maxima."""
        stats = torch.zeros(*shape, self.width, dtype=dtype, device=device)
        if self.maxes:
            stats[..., self.max_start :] = float("-inf")
        return stats

    def reduce(self, keys: torch.Tensor, dim: int) -> torch.Tensor:
        """Statistics of the keys [..., D] along `dim` (which must not be the last)."""
        parts = []
        if self.sums:
            parts.append(keys.sum(dim=dim))
        if self.maxes:
            parts.append(gate_features(keys, self.pooling).amax(dim=dim))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def reduce_blocks(self, keys: torch.Tensor, block_size: int) -> torch.Tensor:
        """Statistics of each block of `block_size` keys along dim -2 of keys [..., N, D]: [..., n_blocks, width];
        a partial last block holds its real keys only."""
        n = keys.shape[-2]
        nb = num_blocks(n, block_size)
        pad = nb * block_size - n
        lead = keys.shape[:-2]
        parts = []
        if self.sums:
            padded = F.pad(keys, (0, 0, 0, pad)) if pad else keys
            parts.append(padded.reshape(*lead, nb, block_size, keys.shape[-1]).sum(dim=-2))
        if self.maxes:
            features = gate_features(keys, self.pooling)
            if pad:
                features = F.pad(features, (0, 0, 0, pad), value=float("-inf"))
            parts.append(features.reshape(*lead, nb, block_size, features.shape[-1]).amax(dim=-2))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def merge(self, stats: torch.Tensor, dim: int) -> torch.Tensor:
        """Statistics of runs [..., width] merged along `dim` (not the last)."""
        if not self.maxes:
            return stats.sum(dim=dim)
        if not self.sums:
            return stats.amax(dim=dim)
        split = self.max_start
        return torch.cat([stats[..., :split].sum(dim=dim), stats[..., split:].amax(dim=dim)], dim=-1)

    def of_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Statistics of single keys [..., D]: [..., width]."""
        if self.pooling == "mean+max":
            return torch.cat([keys, keys], dim=-1)
        return gate_features(keys, self.pooling)

    def merged(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Statistics a and b [..., width] merged entry by entry."""
        if not self.maxes:
            return a + b
        if not self.sums:
            return torch.maximum(a, b)
        split = self.max_start
        return torch.cat([a[..., :split] + b[..., :split], torch.maximum(a[..., split:], b[..., split:])], dim=-1)

    def merge_(self, stats: torch.Tensor, more: torch.Tensor) -> None:
        """`merged` written into `stats` (in place, no temporaries)."""
        split = self.max_start
        if self.sums:
            stats[..., :split] += more[..., :split]
        if self.maxes:
            maxes = stats[..., split:]
            torch.maximum(maxes, more[..., split:], out=maxes)

    def scattered(self, stats: torch.Tensor, dim: int, index: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """stats with keys [..., r, ..., D] added into the entries `index` (r,) names along `dim`."""
        split = self.max_start
        parts = []
        if self.sums:
            parts.append(stats[..., :split].index_add(dim, index, keys))
        if self.maxes:
            features = gate_features(keys, self.pooling)
            shape = [1] * features.dim()
            shape[dim] = index.numel()
            where = index.view(shape).expand(*features.shape)
            parts.append(stats[..., split:].scatter_reduce(dim, where, features, "amax"))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def pooled(self, stats: torch.Tensor, counts: torch.Tensor | int) -> torch.Tensor:
        """Pooled keys from statistics [..., width] of `counts` keys each (a float tensor broadcast against
        stats[..., 0], or one int for all): the mean part divided by the count, the max part zero where there is
        no key."""
        split = self.max_start
        parts = []
        if isinstance(counts, int):  # one count (whole blocks): no per-entry mask
            if self.sums:
                parts.append(stats[..., :split] / max(counts, 1))
            if self.maxes:
                parts.append(stats[..., split:] if counts else torch.zeros_like(stats[..., split:]))
        else:
            if self.sums:
                parts.append(stats[..., :split] / counts.clamp(min=1)[..., None])
            if self.maxes:
                parts.append(stats[..., split:].masked_fill((counts == 0)[..., None], 0.0))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def pool_into(self, stats: torch.Tensor, count: int, out: torch.Tensor) -> None:
        """`pooled` for statistics of one count, written into `out` (in place, no temporaries)."""
        split = self.max_start
        if self.sums:
            torch.div(stats[..., :split], max(count, 1), out=out[..., :split])
        if self.maxes:
            target = out[..., split:]
            target.copy_(stats[..., split:]) if count else target.zero_()


def pooled_keys(k: torch.Tensor, block_size: int, pooling: str) -> torch.Tensor:
    """Pool each block's keys: [B, Hkv, Nk, D] -> [B, Hkv, n_blocks, D] (2D for "mean+max" and "bound").

    "bound" keeps each channel's max and min (as max of -k), Quest's bound on q.k over the block.
    Computed in float32 (float64 stays float64); a partial last block pools only its real keys.
    """
    n = k.shape[2]
    block_size = effective_block_size(block_size, n)
    nb = num_blocks(n, block_size)
    kf = k.to(gate_dtype(k.dtype))
    counts = torch.full((nb,), float(block_size), dtype=kf.dtype, device=k.device)
    counts[-1] = n - (nb - 1) * block_size
    pool = BlockStats.of(pooling, k.shape[3])
    return pool.pooled(pool.reduce_blocks(kf, block_size), counts)


def gate_features(k: torch.Tensor, pooling: str) -> torch.Tensor:
    """Per-key features that the pooling reduces: k itself, or [k, -k] for "bound" (max of -k = -min)."""
    return torch.cat([k, -k], dim=-1) if pooling == "bound" else k


def gate_width(head_dim: int, pooling: str) -> int:
    """Last dim of the pooled keys."""
    return 2 * head_dim if pooling in ("mean+max", "bound") else head_dim


def gate_queries(q: torch.Tensor, pooling: str) -> torch.Tensor:
    """Queries in the pooled keys' feature space, so that a dot product gives the gate score.

    "mean+max": [q, q] (the sum of both scores). "bound": [relu(q), relu(-q)] against [max k, -min k] gives
    sum_d max(q_d max_d, q_d min_d), the largest q.k any key of the block can reach.
    """
    if pooling == "mean+max":
        return torch.cat([q, q], dim=-1)
    if pooling == "bound":
        if (torch.is_grad_enabled() and q.requires_grad) or torch.compiler.is_compiling():
            return torch.cat([q.clamp(min=0), (-q).clamp(min=0)], dim=-1)
        d = q.shape[-1]  # eager selection (no grad): the halves written into one buffer, no concatenation pass
        features = q.new_empty((*q.shape[:-1], 2 * d))
        torch.clamp(q, min=0, out=features[..., :d])
        torch.neg(q, out=features[..., d:]).clamp_(min=0)
        return features
    return q
