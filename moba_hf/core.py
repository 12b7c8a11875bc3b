"""The attention of one sequence under an `AttentionPlan`, whatever holds its keys: the core every host calls.

`plan_for` is the one reader of a `MobaConfig` on the attention path: it resolves, once per config and model,
the frozen `AttentionPlan` that says which keys each query sees (the prompt's and the decode step's
`kernels.plan.BlockPlan`, the decode mode, the full-attention layers, DCA's parameters, the backend). Every host
(the transformers attention function, `integration.attention`; the vLLM and SGLang backends, `vllm.paged` and
`sglang.pool`) holds that plan, cuts a call into sequences, reads their keys and values as it stores them, and
asks the core which route each sequence takes::

    dense layer / sparse = false / a decode step with decode = "full"   ->  "sdpa"      causal attention
    otherwise                                                           ->  "moba"      MoBA's blocks
    with DCA, once the keys pass one chunk                              ->  "dca", "dca+moba"
    a decode step over a cache kept with pooled keys (decode = "moba")  ->  `decode`    the selected blocks only

A host adds only what is its own: how its cache is read (`kernels.decode.CacheWindows`), where the pooled
keys are kept (`kernels.pooling.BlockStats` per row or per page), DCA's RoPE frequencies (`Dca`), and which
kernel serves its dense work.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import torch

from .config import MobaConfig
from .dca.config import DcaParams
from .kernels import attend_plan, selected_blocks
from .kernels.causal import causal_attention_unchecked
from .kernels.decode import CacheWindows, decode_plan, moba_decode_cache
from .kernels.dual_chunk import dca_attention, dca_selection
from .kernels.plan import BlockPlan

Route = Literal["sdpa", "moba", "dca", "dca+moba"]
# a host's DCA resolution against its model: (the config's dca setting, MoBA's block size when sparse, else None)
# -> DCA's parameters, or None when DCA is off (`integration.rope_remap.resolver`)
DcaResolver = Callable[[Any, "int | None"], "DcaParams | None"]


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Which keys each query sees, for every layer of one model: resolved once per config (`plan_for`), read by
    every host, the core and the sparsity counter.

    prompt:      the `BlockPlan` of a call with several new queries (top_k, dense_tail)
    step:        the `BlockPlan` of a one-query decode step (decode_top_k, no dense tail)
    decode:      what one-query decode steps do: "moba" (sparse) or "full" (dense)
    sparse:      False: every layer attends densely (DCA alone, or nothing)
    full_layers: the layer indices that keep full attention
    dca:         DCA's parameters resolved against the model; None: DCA is off
    backend:     the kernel backend's name ("auto" picks per call)
    """

    prompt: BlockPlan
    step: BlockPlan
    decode: str
    sparse: bool
    full_layers: frozenset[int]
    dca: DcaParams | None
    backend: str

    @property
    def block_size(self) -> int:
        return self.prompt.block_size

    @property
    def pooling(self) -> str:
        return self.prompt.gate.pooling

    def blocks(self, num_queries: int) -> BlockPlan:
        """The `BlockPlan` of a call with `num_queries` new queries: a decode step's (one query) or a prompt's."""
        return self.step if num_queries == 1 else self.prompt

    def tail_queries(self, num_queries: int) -> int:
        """How many of a call's `num_queries` new queries attend densely (`dense_tail`; none in a decode step)."""
        return min(self.blocks(num_queries).dense_tail, num_queries)

    def dense_layer(self, layer: int | None) -> bool:
        """Whether layer `layer` attends densely: sparse = false, or one of the full-attention layers (a module
        without a layer index is never one)."""
        return not self.sparse or (layer is not None and layer in self.full_layers)

    def dense_decode(self, num_queries: int) -> bool:
        """Whether a call of `num_queries` new queries is a decode step that runs dense (decode = "full")."""
        return num_queries == 1 and self.decode == "full"

    def sparse_decode(self, layer: int | None) -> bool:
        """Whether decode steps of `layer` read MoBA's blocks through pooled keys kept beside the cache: decode =
        "moba" on a sparse layer, without DCA (whose steps attend per sequence)."""
        return self.decode == "moba" and self.dca is None and not self.dense_layer(layer)


def plan_for(config: MobaConfig, num_layers: int, dca: DcaParams | DcaResolver | None = None) -> AttentionPlan:
    """The `AttentionPlan` of `config` in a model of `num_layers` layers; the same object for the same arguments.

    dca: DCA's parameters as the host resolved them against its model (None: off), or the host's resolver
    (`DcaResolver`), which is handed the config's dca setting and MoBA's block size here. Bad full-attention layer
    ids (and the resolver's refusals) raise ValueError naming them."""
    full_layers = config.full_layer_set(num_layers)  # bad layer ids first, then DCA's refusals
    if callable(dca):
        dca = dca(config.dca, config.block_size if config.sparse else None)
    return _plan(config, full_layers, dca)


@functools.lru_cache(maxsize=64)
def _plan(config: MobaConfig, full_layers: frozenset[int], dca: DcaParams | None) -> AttentionPlan:
    return AttentionPlan(
        prompt=config.plan(2),  # any call of several new queries
        step=config.plan(1),
        decode=config.decode,
        sparse=config.sparse,
        full_layers=full_layers,
        dca=dca,
        backend=config.backend,
    )


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


def runs_dense(plan: AttentionPlan, num_queries: int, dense_layer: bool) -> bool:
    """Whether a sequence's queries attend densely: a full-attention layer (`plan.dense_layer`'s answer),
    sparse = false, or a decode step (one query) with decode = "full"."""
    return dense_layer or not plan.sparse or plan.dense_decode(num_queries)


def route(dense: bool, num_keys: int, dca: Dca | None) -> Route:
    """Which attention a sequence over `num_keys` keys gets; `dense`: `runs_dense`'s answer for it."""
    if dca is not None and dca.applies(num_keys):
        return "dca" if dense else "dca+moba"
    return "sdpa" if dense else "moba"


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: AttentionPlan,
    scale: float | None,
    route: Route,
    dca: Dca | None = None,
) -> torch.Tensor:
    """q: [B, Hq, Nq, D], the last Nq positions of k, v: [B, Hkv, Nk, D] (the rows share one layout) ->
    [B, Hq, Nq, D] along `route` (`route`'s answer). q, k, v are a model's own (shapes and dtypes by
    construction): dense attention runs without the public entries' checks."""
    nq, nk = q.shape[2], k.shape[2]
    if route in ("dca", "dca+moba"):
        blocks = None if route == "dca" else plan.blocks(nq)
        return dca_attention(q, k, v, **dca.kwargs(nk), scale=scale, plan=blocks)
    if route == "sdpa":
        return causal_attention_unchecked(q, k, v, scale)
    return attend_plan(q, k, v, plan.blocks(nq), scale, backend=plan.backend)


def selection(q: torch.Tensor, k: torch.Tensor, plan: AttentionPlan, dca: Dca | None = None) -> torch.Tensor:
    """The blocks the "moba" (or, with `dca`, "dca+moba") route lets each query attend: bool [B, Hq, Nq,
    n_blocks], before any dense tail. What sparsity tracking counts when the budget is adaptive (`top_p`)."""
    blocks = plan.blocks(q.shape[2])
    if dca is None:
        return selected_blocks(q, k, block_size=blocks.block_size, top_k=blocks.top_k, gate=blocks.gate)
    p = dca.params
    return dca_selection(
        q, k, pretraining_length=p.pretraining_length, chunk_size=p.chunk_size, inv_freq=dca.inv_freq, plan=blocks
    )


def decode(
    q: torch.Tensor,
    cache: CacheWindows | tuple[torch.Tensor, torch.Tensor],
    block_keys: torch.Tensor,
    plan: AttentionPlan,
    scale: float | None,
    *,
    starts: torch.Tensor | None = None,
    return_selection: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode: a few new queries q [B, Hq, Nq, D] over a cache, reading the blocks MoBA's gate selects
    with `block_keys` (the pooled keys the host keeps beside its cache) and nothing else.

    cache: (k, v) tensors [B, Hkv, Nk, D] (rows may start at `starts`, left padding), or any `CacheWindows`
    (a paged cache: rows start at position 0). The same math as `attend` on the "moba" route."""
    # a decode call's queries are new tokens: no tail (`cache.cached_step`)
    blocks = plan.blocks(q.shape[2]).sparse
    if isinstance(cache, tuple):
        k, v = cache
        return decode_plan(q, k, v, block_keys, blocks, scale, starts=starts, return_selection=return_selection)
    if starts is not None or return_selection:
        raise ValueError("decode over a windowed cache takes rows that start at position 0 and returns no selection")
    return moba_decode_cache(q, cache, block_keys, blocks, scale)
