"""MoBA's per-layer block state, kept beside the transformers `Cache`, and the sparse decode step that reads it.

transformers does not hand the cache to attention functions, so each attention module gets a forward pre-hook
that stashes (weak references to) the call's cache and the layer's keys as they were *before* `cache.update`:
`apply` installs them (and `revert` removes them); a model loaded with plain `attn_implementation="moba"` gets
them the first time `moba_attention_forward` sees each module. The block state is kept beside the cache
(`state.CacheState`, keyed weakly by the cache object), one `BlockState` per layer, so it is freed with the cache
and survives `generate`; a pre-allocated layer's is kept beside that layer's keys tensor instead (`state_owner`),
which the attention call receives itself, so a compiled step, where no hook runs, finds it without the cache.

A state is trusted only if the keys the layer held before this call are the very tensor the state last
summed and the state covers exactly the tokens the cache held before this call (a `DynamicCache` append makes a
new tensor each update; `reset`, `crop`, beam reordering, batch selection or offloading all replace it too; a
`StaticCache` keeps one tensor, whose written length `reset` and `crop` set back, and a new prompt starts again
from 0). Otherwise it is rebuilt once from the cache's keys.

A `StaticCache` (pre-allocated: every layer's keys are [B, Hkv, max_cache_len, D], written up to the tokens seen)
is read through its written slots only (`layout.static_layout` says how many); its block state is allocated for
all max_cache_len tokens at once, and a sparse decode step reads the selected blocks straight from the cache's
tensors (on CPU in float32 / float64 in place through the written slots' prefix views, as any cache; elsewhere
their windows, `StaticWindows`): nothing that grows with the cache is copied.

Per row, blocks are laid out over the row's real tokens (pads dropped, counted from its first real token),
the layout the padded prefill path uses. Rows are packed only in forwards without a cache (transformers' rule,
see `layout`), so the block state never holds documents.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from .. import core
from ..kernels import decode as decode_kernels
from ..kernels import native
from ..kernels.checks import gate_dtype, needs_grad
from ..kernels.pooling import BlockStats
from . import sparsity, state

logger = logging.getLogger("moba_hf")

# above this many new queries a cached step runs the prefill kernel (which gates every query at once)
DECODE_MAX_QUERIES = 8


# --- finding the cache from inside the attention function --------------------------------------------------------
def _find_cache(args: tuple, kwargs: dict) -> Any:
    for name in ("cache", "past_key_values", "past_key_value"):  # transformers renamed it across versions
        if kwargs.get(name) is not None:
            return kwargs[name]
    for arg in args:
        if hasattr(arg, "update") and hasattr(arg, "get_seq_length"):
            return arg
    return None


def _layer_keys(cache: Any, layer_idx: int | None) -> torch.Tensor | None:
    layers = getattr(cache, "layers", None)
    if layer_idx is None or layers is None or layer_idx >= len(layers):
        return None
    keys = getattr(layers[layer_idx], "keys", None)
    return keys if isinstance(keys, torch.Tensor) else None


# The hook runs per layer and token, so it does no more than refuse a pre-allocated layer MoBA cannot read and set
# the layer's `call` (which the attention function takes: `take_call`). Under torch.compile the call is set eagerly
# (whether the block state is in step is a fact of each call, tensor identity, never of a trace). A pre-allocated
# cache needs no call, eager or compiled: its layers' block states are kept beside their keys tensors, which the
# attention call receives itself; traced, the check adds nothing to the graph for a supported layer.
def _pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    cache = _find_cache(args, kwargs)
    if getattr(cache, "is_compileable", False):
        check_cache_supported(cache, getattr(module, "layer_idx", None))  # a few type checks, before the update
        return
    _stash_call(module, args, kwargs)


@torch.compiler.disable
def _stash_call(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    layer_state = state.of_layer(module)
    cache = _find_cache(args, kwargs)
    if cache is None:
        layer_state.call = None
        return
    # decided now, while the layer still holds the keys of the previous step (`update` replaces them)
    layer = getattr(module, "layer_idx", None)
    kept = state.cache_if_any(cache)
    block_state = kept.blocks.get(layer) if kept is not None else None
    if block_state is None:  # no block state (e.g. a plain prefill so far): nothing to be in step with
        layer_state.call = (weakref.ref(cache), False)
        return
    keys = _layer_keys(cache, layer)  # (the count is checked in `block_state`, which knows the tokens written)
    in_step = keys is not None and block_state.keys_ref is not None and block_state.keys_ref() is keys
    layer_state.call = (weakref.ref(cache), in_step)


def install_hooks(module: torch.nn.Module) -> None:
    """Make `module` stash its cache for `take_call` (idempotent; takes effect from the next forward). A copy
    of a module (deepcopy, pickle) brings the hooks along without an entry of its own: they are not added twice."""
    layer_state = state.of_layer(module)
    if layer_state.hooks is not None or any(hook is _pre_hook for hook in module._forward_pre_hooks.values()):
        return
    layer_state.hooks = (module.register_forward_pre_hook(_pre_hook, with_kwargs=True),)
    layer_state.call = None


def install_model_hooks(model: torch.nn.Module, attention_classes: tuple[type, ...]) -> None:
    """`install_hooks` on every attention module of `model` (used by `apply`)."""
    for module in model.modules():
        if isinstance(module, attention_classes):
            install_hooks(module)


def remove_hooks(model: torch.nn.Module) -> None:
    """Undo `install_hooks` on every submodule (used by `revert`)."""
    for module in model.modules():
        layer_state = state.layer_if_any(module)
        if layer_state is not None and layer_state.hooks is not None:
            for handle in layer_state.hooks:
                handle.remove()
            layer_state.hooks = layer_state.call = None


def take_call(module: torch.nn.Module) -> tuple[Any, bool] | None:
    """(cache, whether the layer's block state was built from the keys tensor the layer held before this call) for
    the forward in progress, or None when the call has no cache (or the hook was installed during it). Taken once:
    the attention function takes it at every call, so a later call that bypasses the hook (`module.forward(...)`)
    finds none."""
    layer_state = state.layer_if_any(module)
    call = None if layer_state is None else layer_state.call
    if call is None:
        return None
    layer_state.call = None
    cache = call[0]()
    return None if cache is None else (cache, call[1])


def _cache_layer(cache: Any, layer_idx: int | None) -> Any:
    layers = getattr(cache, "layers", None) or []
    return layers[layer_idx] if layer_idx is not None and layer_idx < len(layers) else None


def is_static(cache: Any, layer_idx: int | None) -> bool:
    """Whether the layer's cache is pre-allocated (a StaticCache layer: keys of all max_cache_len slots)."""
    return bool(getattr(_cache_layer(cache, layer_idx), "is_compileable", False))


def check_cache_supported(cache: Any, layer_idx: int | None) -> None:
    from transformers.cache_utils import StaticLayer

    layer = _cache_layer(cache, layer_idx)
    if layer is None and getattr(cache, "is_compileable", False):
        raise ValueError(f"moba attention cannot read {type(cache).__name__}: it has no layer {layer_idx}")
    if getattr(layer, "is_compileable", False) and (
        not isinstance(layer, StaticLayer) or getattr(layer, "is_sliding", False)
    ):
        raise ValueError(
            f"moba attention takes a DynamicCache or a StaticCache's full-attention layers; layer {layer_idx} of "
            f"{type(cache).__name__} is a {type(layer).__name__} (a sliding-window or other pre-allocated layer)"
        )


# --- the block state ------------------------------------------------------------------------------------------
class BlockState:
    """The running pooled-key statistics (`kernels.pooling.BlockStats`) of one layer's cache, per row, block and
    KV head, and the pooled keys derived from them.

    stats, pooled: [B, Hkv, capacity, width]; pooled is what `block_keys` returns, re-derived only for the
    blocks an append touched (a decode step: one block per row); counts[b]: real tokens of row b so far;
    starts[b]: cache position of row b's first real token (= n while it has none); n: cache positions covered;
    common_start: the position every row starts at, None where rows start apart (starts, kept on the host).
    """

    def __init__(
        self, keys: torch.Tensor, block_size: int, pooling: str, capacity: int = 0, reuse: torch.Tensor | None = None
    ) -> None:
        """keys: [B, Hkv, N, D], the cache the state is for (read for its shape, dtype and device); capacity:
        tokens to allocate room for at once (a pre-allocated cache's max_cache_len), 0: grow as tokens come;
        reuse: statistics of a former state of that capacity, emptied and kept (the tensor a captured graph reads)."""
        b, hkv, _, d = keys.shape
        self.block_size = block_size
        self.pooling = pooling
        self.shape = (b, hkv, d)
        self.dtype = gate_dtype(keys.dtype)
        self.device = keys.device
        self.pool = BlockStats.of(pooling, d)
        self.stats = self.pool.empty(b, hkv, 0, dtype=self.dtype, device=keys.device)
        self.pooled = keys.new_zeros(b, hkv, 0, self.pool.width, dtype=self.dtype)
        self._stale = (0, 0)  # blocks lo .. hi - 1 whose pooled keys are out of date
        self._counts = torch.zeros(b, dtype=torch.long, device=keys.device)
        self._counts_behind = 0  # decode steps not yet added to _counts (added when counts is read)
        self.starts = torch.zeros(b, dtype=torch.long, device=keys.device)
        self.n = 0
        # host copies read by every decode step (no tensor op, no device sync)
        self.min_count = self.max_count = 0
        self.common_start: int | None = 0
        self.contiguous = True  # every row's real tokens run without a gap to the end of the cache
        self.keys_ref: weakref.ref | None = None
        if capacity:
            n_blocks = -(-capacity // block_size)
            if reuse is not None and reuse.shape == (b, hkv, n_blocks, self.pool.width) and reuse.dtype == self.dtype:
                self.stats = reuse.copy_(self.pool.empty(b, hkv, n_blocks, dtype=self.dtype, device=keys.device))
                self.pooled = keys.new_zeros(b, hkv, n_blocks, self.pool.width, dtype=self.dtype)
            self._reserve(n_blocks)  # (room for them all: nothing to add where reused)

    @property
    def counts(self) -> torch.Tensor:
        """[B] real tokens of each row so far (a decode step adds its token here only when this is read: one
        tensor op fewer per layer and token)."""
        if self._counts_behind:
            self._counts, self._counts_behind = self._counts + self._counts_behind, 0
        return self._counts

    @counts.setter
    def counts(self, value: torch.Tensor) -> None:
        self._counts, self._counts_behind = value, 0

    def matches(self, keys: torch.Tensor, block_size: int, pooling: str) -> bool:
        b, hkv, _, d = keys.shape
        now = (block_size, pooling, (b, hkv, d), gate_dtype(keys.dtype), keys.device)
        return now == (self.block_size, self.pooling, self.shape, self.dtype, self.device)

    def _reserve(self, n_blocks: int) -> None:
        have = self.pooled.shape[2]
        if n_blocks <= have:
            return
        grow = max(n_blocks, 2 * have) - have  # amortized doubling: no realloc per block
        b, hkv, _ = self.shape
        more = self.pool.empty(b, hkv, grow, dtype=self.dtype, device=self.device)
        self.stats = torch.cat([self.stats, more], dim=2)
        self.pooled = F.pad(self.pooled, (0, 0, 0, grow))

    def append(self, keys: torch.Tensor, real: torch.Tensor | None) -> None:
        """Add new cache tokens keys [B, Hkv, T, D]; real [B, T] bool marks non-pad tokens (None: all real).

        The statistics are kept without autograd history: the gate only selects blocks (no gradient flows
        through the selection, as in the prefill kernels), and the in-place updates of a decode step could not
        be differentiated."""
        t = keys.shape[2]
        if t == 0:
            return
        if real is not None and bool(real.all()):
            real = None
        if real is None and t == 1 and self.min_count == self.max_count:
            self._append_token(keys)
            return
        keys = keys.detach()
        first_block = self.min_count // self.block_size
        if real is None and t == 1:
            # one new token per row (decode, rows of any length): one indexed update of each row's current block
            rows = torch.arange(keys.shape[0], device=keys.device)
            blocks = self.counts // self.block_size
            self._reserve(self.max_count // self.block_size + 1)
            x = keys[:, :, 0].to(self.dtype)  # [B, Hkv, D]
            self.stats[rows, :, blocks] = self.pool.merged(self.stats[rows, :, blocks], self.pool.of_keys(x))
        elif real is None and self.min_count == self.max_count:
            self._accumulate(slice(None), keys, self.min_count)
        else:
            counts = self.counts.tolist()
            for row in range(keys.shape[0]):
                x = keys[row : row + 1] if real is None else keys[row : row + 1, :, real[row]]
                if x.shape[2]:
                    self._accumulate(slice(row, row + 1), x, counts[row])
        if real is None:
            self.starts = torch.where(self.counts == 0, self.n, self.starts)
            if self.max_count == 0:  # every row starts now (rows that start apart stay apart)
                self.common_start = self.n
            self.counts = self.counts + t
            self.min_count, self.max_count = self.min_count + t, self.max_count + t
        else:  # padded rows (a prefill): the host copies are read back once
            first_new = torch.where(real.any(-1), real.to(torch.int8).argmax(-1), t)
            self.starts = torch.where(self.counts == 0, self.n + first_new, self.starts)
            self.counts = self.counts + real.sum(-1)
            self.min_count, self.max_count = int(self.counts.min()), int(self.counts.max())
        self.n += t
        if real is not None:
            self.contiguous = bool((self.starts + self.counts == self.n).all())
            low, high = self.starts.aminmax()
            self.common_start = int(low) if int(low) == int(high) else None
        # (all-real tokens keep rows as they were: a contiguous row stays contiguous, a gap stays)
        last_block = -(-self.max_count // self.block_size)
        lo, hi = self._stale
        self._stale = (first_block, last_block) if hi <= lo else (min(lo, first_block), max(hi, last_block))

    def _append_token(self, keys: torch.Tensor) -> None:
        """One new real token per row (keys [B, Hkv, 1, D]), every row holding as many (a decode step without
        padding): a few in-place ops on one block, no index tensor (this runs per layer and token)."""
        count = self.min_count
        block = count // self.block_size
        self._reserve(block + 1)
        # in one native call where it is built: the merge and the block's pooled key (current, not stale)
        filled = count + 1 - block * self.block_size
        pooled = native.block_append(self.pool, self.stats, self.pooled, block, keys, filled)
        if not pooled:
            self.pool.merge_(self.stats[:, :, block], self.pool.of_keys(keys[:, :, 0].detach().to(self.dtype)))
        if count == 0:
            self.starts = torch.full_like(self.starts, self.n)
            self.common_start = self.n
        self._counts_behind += 1
        self.min_count = self.max_count = count + 1
        self.n += 1
        if not pooled:
            lo, hi = self._stale
            self._stale = (block, block + 1) if hi <= lo else (min(lo, block), max(hi, block + 1))

    def _accumulate(self, rows: slice, x: torch.Tensor, count: int) -> None:
        """Add x [b, Hkv, r, D], the real tokens count .. count + r - 1 of `rows`, into their blocks."""
        bs, r = self.block_size, x.shape[2]
        first, off = divmod(count, bs)
        n_blk = -(-(off + r) // bs)
        self._reserve(first + n_blk)
        x = x.to(self.dtype)
        if n_blk == 1:  # one block, no padding
            self.stats[rows, :, first] = self.pool.merged(self.stats[rows, :, first], self.pool.reduce(x, 2))
            return
        # index by block instead of padding to whole blocks: memory follows the tokens, not block_size
        block = (count + torch.arange(r, device=x.device)) // bs
        self.stats[rows] = self.pool.scattered(self.stats[rows], 2, block, x)

    def block_keys(self, n_blocks: int | None = None) -> torch.Tensor:
        """Pooled keys [B, Hkv, n_blocks, D (2D for mean+max and bound)] in each row's sequence layout (blocks no
        row has reached are zeros). A view of the kept pooled keys: valid until the next `append`."""
        bs = self.block_size
        nb = -(-self.max_count // bs) if n_blocks is None else n_blocks
        self._reserve(nb)
        lo, hi = self._stale
        if hi - lo == 1 and self.min_count == self.max_count:  # a decode step: one block, one fill for all rows
            self._pool_block(lo, min(bs, max(0, self.min_count - lo * bs)))
        elif hi > lo:
            filled = (self.counts[:, None] - torch.arange(lo, hi, device=self.device) * bs).clamp(0, bs)
            # empty (future) blocks pool to zeros, never selected
            self.pooled[:, :, lo:hi] = self.pool.pooled(self.stats[:, :, lo:hi], filled.to(self.dtype)[:, None])
            self._stale = (0, 0)
        return self.pooled[:, :, :nb]

    def _pool_block(self, block: int, filled: int) -> None:
        """Re-derive the pooled key of `block`, which holds `filled` keys in every row (the arithmetic of the
        general case in `block_keys`, written in place)."""
        self.pool.pool_into(self.stats[:, :, block], filled, self.pooled[:, :, block])
        self._stale = (0, 0)

    def contiguous_rows(self) -> bool:
        """Every row's real tokens run without a gap to the end of the cache (left padding at most)."""
        return self.contiguous


def block_state(
    owner: Any,
    layer_idx: int,
    keys: torch.Tensor,
    in_step: bool,
    padding_mask: torch.Tensor | None,
    plan: core.AttentionPlan,
    *,
    new: int,
    create: bool = True,
    stored: torch.Tensor | None = None,
) -> BlockState | None:
    """This layer's state, synced to `keys` (the cache after this call's update): appended to if it was
    `in_step` (built from the layer's keys tensor) and covering exactly the nk - `new` tokens the cache held
    before the update, rebuilt from all keys otherwise.
    owner: what the state is kept beside (`state_owner`); stored: a pre-allocated layer's keys [B, Hkv, capacity,
    D] (`keys` are its written slots), None for a growing cache.
    padding_mask: [B, Nk] bool or None. With create=False a missing or stale state is not (re)built."""
    kept = state.of_cache(owner) if create else state.cache_if_any(owner)
    if kept is None:
        return None
    states = kept.blocks
    running = states.get(layer_idx)
    if running is None and not create:
        return None
    nk = keys.shape[2]
    fresh = running is not None and in_step and running.n == nk - new
    fresh = fresh and running.matches(keys, plan.block_size, plan.pooling)
    if not fresh and not create:  # stale and not needed now: rebuild lazily at the next decode step
        del states[layer_idx]
        return None
    if not fresh:
        if running is not None:
            logger.debug("moba_hf: layer %s block state out of date; rebuilding from %d cached keys", layer_idx, nk)
        capacity = 0 if stored is None else stored.shape[2]
        reuse = None if stored is None else getattr(stored, GRAPH_STATS, None)
        running = BlockState(keys, plan.block_size, plan.pooling, capacity, reuse)
        states[layer_idx] = running
    real = None if padding_mask is None else padding_mask[:, running.n : nk]
    running.append(keys[:, :, running.n :], real)
    if stored is None:  # the cache's own tensor (what the hook compares at the next call)
        stored = _layer_keys(owner, layer_idx)
    elif stored.device.type in GRAPH_STEP_DEVICES:
        _share_with_graph_steps(stored, running)
    running.keys_ref = weakref.ref(keys if stored is None else stored)
    return running


# --- the block state of captured steps ------------------------------------------------------------------------------
# On these devices a compiled one-token step over a pre-allocated cache runs `kernels.graph_step` (fixed shapes, no
# host read: a CUDA graph can capture it) instead of the `moba_hf::attention` op; both compute the same attention.
# Such a step finds its layer's statistics on the keys tensor it receives, GRAPH_STATS, with GRAPH_SLOTS: the cache
# slots they cover (a 0-d tensor). Each eager or op call that keeps the state sets both; each captured step merges
# its key into the statistics and moves the count on (the host's `BlockState` is then behind: its next call rebuilds
# it, into the same tensor).
GRAPH_STEP_DEVICES = frozenset({"cuda"})
GRAPH_STATS, GRAPH_SLOTS = "moba_block_stats", "moba_block_slots"


def _share_with_graph_steps(stored: torch.Tensor, running: BlockState) -> None:
    if getattr(stored, GRAPH_STATS, None) is not running.stats:
        setattr(stored, GRAPH_STATS, running.stats)
        setattr(stored, GRAPH_SLOTS, torch.zeros((), dtype=torch.long, device=stored.device))
        for t in (running.stats, getattr(stored, GRAPH_SLOTS)):  # at a fixed address, as the cache's own tensors
            torch._dynamo.mark_static_address(t)
    getattr(stored, GRAPH_SLOTS).fill_(running.n)


def state_owner(cache: Any, layer_idx: int | None) -> Any:
    """What a layer's block state is kept beside: a pre-allocated layer's keys tensor (its slots live as long as
    the layer, and a compiled step reaches them without the cache), otherwise the cache."""
    if is_static(cache, layer_idx):
        keys = _layer_keys(cache, layer_idx)
        if keys is not None:
            return keys
    return cache


def layer_states(cache: Any) -> dict[int, BlockState]:
    """The block states kept for `cache`'s layers, by layer index."""
    found = {}
    for layer in range(len(getattr(cache, "layers", None) or [])):
        kept = state.cache_if_any(state_owner(cache, layer))
        if kept is not None and layer in kept.blocks:
            found[layer] = kept.blocks[layer]
    return found


# --- the cached step ---------------------------------------------------------------------------------------------
def cached_step(
    module: torch.nn.Module,
    call: tuple[Any, bool] | None,
    stored: tuple[torch.Tensor, torch.Tensor] | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding_mask: torch.Tensor | None,
    plan: core.AttentionPlan,
    scale: float | None,
) -> torch.Tensor | None:
    """Sparse decode for a MoBA layer with a cache: [B, Hq, Nq, D], MoBA's blocks over the cache at every step
    whatever its length (the same math as a forward without a cache); or None to run the ordinary path.

    Only with decode="moba", Nq <= DECODE_MAX_QUERIES new queries, every row's real tokens contiguous and
    all new tokens real (what `generate` does, left padding included). Otherwise the block state, if the
    layer has one, is just kept in step.
    call: `take_call(module)`; stored: a pre-allocated layer's keys and values [B, Hkv, capacity, D] (key and value
    are their written slots), None for a growing cache. A compiled step over a pre-allocated cache has no call (no
    hook runs there): its block state is kept beside the keys tensor, found without the cache.
    """
    if call is None and stored is None:
        install_hooks(module)  # nothing to do once installed; hooks take effect from the next forward
        return None
    if padding_mask is not None and padding_mask.dtype != torch.bool:  # packed document ids: never with a cache
        padding_mask = None
    layer = getattr(module, "layer_idx", None)
    # the hook has refused a pre-allocated layer MoBA cannot read (`check_cache_supported`); such a layer's state is
    # kept beside its keys tensor: in step with it whenever found there
    owner, in_step = (stored[0], True) if stored is not None else call
    nq, nk = query.shape[2], key.shape[2]
    decode = plan.sparse_decode(layer) and nq < nk and nq <= DECODE_MAX_QUERIES and layer is not None
    decode = decode and not plan.tail_queries(nq)  # a dense tail runs on the prefill path
    running = None
    if layer is not None:
        keys = None if stored is None else stored[0]
        # where steps are captured, a prompt builds the state too: no eager code runs at those steps to build it
        create = decode or (keys is not None and keys.device.type in GRAPH_STEP_DEVICES and plan.sparse_decode(layer))
        running = block_state(owner, layer, key, in_step, padding_mask, plan, new=nq, create=create, stored=keys)
    if not decode or running is None or not running.contiguous_rows() or running.min_count < nq:
        return None
    tracking = sparsity.tracking()  # the selection is asked for only when it is recorded
    block_keys = running.block_keys()
    static = stored is not None and not tracking and not needs_grad(query, key, value)
    if static and not decode_kernels.reads_in_place(query, key, value):
        # (on CPU in float32 / float64 the step reads the written slots' prefix views in place, as any cache's)
        return _static_decode(query, stored[0], stored[1], nk, running, block_keys, plan, scale)
    starts = None if running.common_start == 0 else running.starts  # None: every row from 0 (no reductions)
    out = core.decode(query, (key, value), block_keys, plan, scale, starts=starts, return_selection=tracking)
    if not tracking:
        return out
    out, selected = out
    attended = sum(
        sparsity.attended_pairs(selected[r : r + 1], int(running.counts[r]), plan.block_size)
        for r in range(query.shape[0])
    )
    causal = sum(sparsity.causal_pairs(query.shape[1], nq, int(c)) for c in running.counts.tolist())
    sparsity.record(layer, attended, causal, "decode")
    return out


# --- a sparse step over a pre-allocated cache ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StaticWindows:
    """The sequences of a pre-allocated cache as `kernels.decode.CacheWindows`: k, v [B, Hkv, capacity, D] the
    cache's (contiguous) tensors, each row's sequence at cache positions first .. first + length - 1. A window
    is one contiguous run of width * D numbers, read as a row of an overlapping strided view: one `index_select`
    per tensor copies the windows and nothing else (a [B, Hkv, written, D] view of the cache is strided: read as
    such, it would be copied whole)."""

    k: torch.Tensor
    v: torch.Tensor
    first: int
    length: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, hkv, _, d = self.k.shape
        return (b, hkv, self.length, d)

    def windows(self, start: torch.Tensor, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        b, hkv, capacity, d = self.k.shape
        base = torch.arange(b * hkv, device=start.device).view(b, hkv, 1) * capacity + self.first
        index = (base + start).flatten()
        out = []
        for t in (self.k, self.v):
            flat = t.view(-1)
            rows = flat.as_strided((flat.numel() // d - width + 1, width * d), (d, 1))
            out.append(rows.index_select(0, index).view(b, hkv, -1, d).to(dtype))
        return out[0], out[1]


def _static_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    written: int,
    running: BlockState,
    block_keys: torch.Tensor,
    plan: core.AttentionPlan,
    scale: float | None,
) -> torch.Tensor:
    """The sparse step over a StaticCache's tensors keys, values [B, Hkv, capacity, D], `written` slots filled,
    each row's real tokens ending there, where the step copies windows (bfloat16, CUDA: a strided view of
    the written slots would be copied whole): rows of one length in one call, left-padded rows of other lengths one
    by one (the windowed read takes rows of one length)."""
    if running.min_count == running.max_count:
        count = running.max_count
        return core.decode(query, StaticWindows(keys, values, written - count, count), block_keys, plan, scale)
    out = torch.empty_like(query)
    for row, count in enumerate(running.counts.tolist()):
        rows = slice(row, row + 1)
        cache = StaticWindows(keys[rows], values[rows], written - count, count)
        out[rows] = core.decode(query[rows], cache, block_keys[rows], plan, scale)
    return out
