"""The attention of one sequence under a MobaConfig, whatever holds its keys: the core both hosts call.

The transformers attention function (`integration.attention`) and the vLLM backend (`vllm.paged`) each cut a
call into sequences and read their keys and values as the host stores them; for every sequence they ask the
core which route it takes and run it here::

    dense layer / sparse = false / a decode step with decode = "full"   ->  "sdpa"      causal attention
    otherwise                                                           ->  "moba"      MoBA's blocks
    with DCA, once the keys pass one chunk                              ->  "dca", "dca+moba"
    a decode step over a cache kept with pooled keys (decode = "moba")  ->  `decode`    the selected blocks only

A host adds only what is its own: how its cache is read (`kernels.decode.CacheWindows`), where the pooled
keys are kept (`kernels.pooling.BlockStats` per row or per page), and which kernel serves its dense work.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from .config import MobaConfig
from .dca.config import DcaParams
from .kernels import attend_plan, selected_blocks
from .kernels.causal import causal_attention_unchecked
from .kernels.decode import CacheWindows, decode_plan, moba_decode_cache
from .kernels.dual_chunk import dca_attention, dca_selection

Route = Literal["sdpa", "moba", "dca", "dca+moba"]


@dataclasses.dataclass(frozen=True)
class Dca:
    """Dual Chunk Attention as a sequence runs it: resolved c, s and temperature, and the model's RoPE inverse
    frequencies [D / 2] (float32). Queries and keys reach the core already moved to their DCA positions."""

    params: DcaParams
    inv_freq: torch.Tensor

    def applies(self, num_keys: int) -> bool:
        """DCA changes nothing while a sequence fits in one chunk: the plain route then runs (bit-exact)."""
        return num_keys > self.params.chunk_size

    def kwargs(self, num_keys: int) -> dict[str, object]:
        """`dca_attention`'s DCA keywords for a sequence of `num_keys` keys."""
        p = self.params
        return dict(
            pretraining_length=p.pretraining_length,
            chunk_size=p.chunk_size,
            inv_freq=self.inv_freq,
            temperature=p.temperature_factor(num_keys),
        )


def runs_dense(config: MobaConfig, num_queries: int, dense_layer: bool) -> bool:
    """Whether a sequence's queries attend densely: a full-attention layer, sparse = false, or a decode step
    (one query) with decode = "full"."""
    return dense_layer or not config.sparse or (num_queries == 1 and config.decode == "full")


def route(dense: bool, num_keys: int, dca: Dca | None) -> Route:
    """Which attention a sequence over `num_keys` keys gets; `dense`: `runs_dense`'s answer for it."""
    if dca is not None and dca.applies(num_keys):
        return "dca" if dense else "dca+moba"
    return "sdpa" if dense else "moba"


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: MobaConfig,
    scale: float | None,
    route: Route,
    dca: Dca | None = None,
) -> torch.Tensor:
    """q: [B, Hq, Nq, D], the last Nq positions of k, v: [B, Hkv, Nk, D] (the rows share one layout) ->
    [B, Hq, Nq, D] along `route` (`route`'s answer). q, k, v are a model's own (shapes and dtypes by
    construction): dense attention runs without the public entries' checks."""
    nq, nk = q.shape[2], k.shape[2]
    if route in ("dca", "dca+moba"):
        plan = None if route == "dca" else config.plan(nq)
        return dca_attention(q, k, v, **dca.kwargs(nk), scale=scale, plan=plan)
    if route == "sdpa":
        return causal_attention_unchecked(q, k, v, scale)
    return attend_plan(q, k, v, config.plan(nq), scale, backend=config.backend)


def selection(q: torch.Tensor, k: torch.Tensor, config: MobaConfig, dca: Dca | None = None) -> torch.Tensor:
    """The blocks the "moba" (or, with `dca`, "dca+moba") route lets each query attend: bool [B, Hq, Nq,
    n_blocks], before any dense tail. What sparsity tracking counts when the budget is adaptive (`top_p`)."""
    plan = config.plan(q.shape[2])
    if dca is None:
        return selected_blocks(q, k, block_size=plan.block_size, top_k=plan.top_k, gate=plan.gate)
    p = dca.params
    return dca_selection(
        q, k, pretraining_length=p.pretraining_length, chunk_size=p.chunk_size, inv_freq=dca.inv_freq, plan=plan
    )


def decode(
    q: torch.Tensor,
    cache: CacheWindows | tuple[torch.Tensor, torch.Tensor],
    block_keys: torch.Tensor,
    config: MobaConfig,
    scale: float | None,
    *,
    starts: torch.Tensor | None = None,
    return_selection: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode: a few new queries q [B, Hq, Nq, D] over a cache, reading the blocks MoBA's gate selects
    with `block_keys` (the pooled keys the host keeps beside its cache) and nothing else.

    cache: (k, v) tensors [B, Hkv, Nk, D] (rows may start at `starts`, left padding), or any `CacheWindows`
    (a paged cache: rows start at position 0). The same math as `attend` on the "moba" route."""
    plan = config.plan(q.shape[2]).sparse  # a decode call's queries are new tokens: no tail (`cache.cached_step`)
    if isinstance(cache, tuple):
        k, v = cache
        return decode_plan(q, k, v, block_keys, plan, scale, starts=starts, return_selection=return_selection)
    if starts is not None or return_selection:
        raise ValueError("decode over a windowed cache takes rows that start at position 0 and returns no selection")
    return moba_decode_cache(q, cache, block_keys, plan, scale)
