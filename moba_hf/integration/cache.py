"""MoBA's per-layer block state, kept on the transformers `Cache`, and the sparse decode step that reads it.

transformers does not hand the cache to attention functions, so each attention module gets a forward pre-hook
that stashes (weak references to) the call's cache and the layer's keys as they were *before* `cache.update`:
`apply` installs them (and `revert` removes them); a model loaded with plain `attn_implementation="moba"` gets
them the first time `moba_attention_forward` sees each module. The block state lives in a dict on the cache
object, one `BlockState` per layer, so it is freed with the cache and survives `generate`.

A state is trusted only if the keys the layer held before this call are the very tensor the state last
summed (a `DynamicCache` append makes a new tensor each update; `reset`, `crop`, beam reordering, batch
selection or offloading all replace it too). Otherwise it is rebuilt once from the cache's keys.

Per row, blocks are laid out over the row's real tokens (pads dropped, counted from its first real token),
the layout the padded prefill path uses. Rows are packed only in forwards without a cache (transformers' rule,
see `layout`), so the block state never holds documents.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from ..config import MobaConfig
from ..kernels.common import gate_dtype, gate_features
from ..kernels.decode import decode_crossover, moba_decode
from . import sparsity

logger = logging.getLogger("moba_hf")

# above this many new queries a cached step runs the prefill kernel (which gates every query at once)
DECODE_MAX_QUERIES = 8
DENSE_STEP = "dense"  # `cached_step`'s answer when a dense step is the cheaper one

_STATE_ATTR = "_moba_block_state"  # on the Cache: {layer_idx: BlockState}
_CALL_ATTR = "_moba_call"  # on the attention module, during its forward: (cache ref, keys-before-update ref)
_HOOKS_ATTR = "_moba_cache_hooks"  # on the attention module: hook handles
_CHECKED_ATTR = "_moba_checked_layers"  # on the Cache: the layers `check_cache_supported` passed
_STEP_ATTR = "_moba_step"  # on the Cache: the crossover of the forward in progress, with what it depends on


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


# The hooks run twice per layer and token: they write the module's __dict__ directly, which is what
# nn.Module.__setattr__ does for a plain value after its (here needless) checks for parameters and submodules.
def _pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    cache = _find_cache(args, kwargs)
    if cache is None:
        module.__dict__[_CALL_ATTR] = None
        return
    # decided now, while the layer still holds the keys of the previous step (`update` replaces them)
    layer = getattr(module, "layer_idx", None)
    states = getattr(cache, _STATE_ATTR, None)
    state = states.get(layer) if states else None
    if state is None:  # no block state (e.g. every step so far dense): nothing to be in step with
        module.__dict__[_CALL_ATTR] = (weakref.ref(cache), False)
        return
    keys = _layer_keys(cache, layer)
    in_step = keys is not None and state.keys_ref is not None and state.keys_ref() is keys
    module.__dict__[_CALL_ATTR] = (weakref.ref(cache), in_step and state.n == keys.shape[2])


def _post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    module.__dict__[_CALL_ATTR] = None


def install_hooks(module: torch.nn.Module) -> None:
    """Make `module` stash its cache for `current_call` (idempotent; takes effect from the next forward)."""
    if getattr(module, _HOOKS_ATTR, None) is not None:
        return
    handles = (
        module.register_forward_pre_hook(_pre_hook, with_kwargs=True),
        module.register_forward_hook(_post_hook, with_kwargs=True, always_call=True),
    )
    setattr(module, _HOOKS_ATTR, handles)
    setattr(module, _CALL_ATTR, None)


def install_model_hooks(model: torch.nn.Module, attention_classes: tuple[type, ...]) -> None:
    """`install_hooks` on every attention module of `model` (used by `apply`)."""
    for module in model.modules():
        if isinstance(module, attention_classes):
            install_hooks(module)


def remove_hooks(model: torch.nn.Module) -> None:
    """Undo `install_hooks` on every submodule (used by `revert`)."""
    for module in model.modules():
        handles = getattr(module, _HOOKS_ATTR, None)
        if handles is not None:
            for handle in handles:
                handle.remove()
            delattr(module, _HOOKS_ATTR)
            if hasattr(module, _CALL_ATTR):
                delattr(module, _CALL_ATTR)


def current_call(module: torch.nn.Module) -> tuple[Any, bool] | None:
    """(cache, whether the layer's block state covered exactly its keys before this call) for the forward in
    progress, or None when the call has no cache (or the hooks were installed during it)."""
    call = getattr(module, _CALL_ATTR, None)
    if call is None:
        return None
    cache = call[0]()
    return None if cache is None else (cache, call[1])


def check_cache_supported(cache: Any, layer_idx: int | None) -> None:
    layers = getattr(cache, "layers", None) or []
    layer = layers[layer_idx] if layer_idx is not None and layer_idx < len(layers) else None
    if getattr(cache, "is_compileable", False) or getattr(layer, "is_compileable", False):
        raise ValueError(
            f"moba attention needs a growing cache (DynamicCache, the default); got {type(cache).__name__} "
            f"(StaticCache / pre-allocated caches are not supported: drop cache_implementation='static')"
        )


# --- the block state ------------------------------------------------------------------------------------------
class BlockState:
    """Running per-block key sums (and maxima, for max / bound pooling) of one layer's cache, per row and KV head.

    sums / maxes: [B, Hkv, capacity, D] (maxes: 2D for bound, the max of [k, -k]); counts[b]: real tokens of row
    b so far; starts[b]: cache position of row b's first real token (= n while it has none); n: cache positions
    covered.
    """

    def __init__(self, keys: torch.Tensor, block_size: int, pooling: str) -> None:
        b, hkv, _, d = keys.shape
        self.block_size = block_size
        self.pooling = pooling
        self.shape = (b, hkv, d)
        self.dtype = gate_dtype(keys.dtype)
        self.device = keys.device
        self.sums = keys.new_zeros(b, hkv, 0, d, dtype=self.dtype) if pooling in ("mean", "mean+max") else None
        empty = keys.new_zeros(b, hkv, 0, d, dtype=self.dtype)
        self.maxes = gate_features(empty, pooling) if pooling != "mean" else None  # 2D wide for bound
        self.counts = torch.zeros(b, dtype=torch.long, device=keys.device)
        self.starts = torch.zeros(b, dtype=torch.long, device=keys.device)
        self.n = 0
        self.keys_ref: weakref.ref | None = None

    def matches(self, keys: torch.Tensor, block_size: int, pooling: str) -> bool:
        b, hkv, _, d = keys.shape
        now = (block_size, pooling, (b, hkv, d), gate_dtype(keys.dtype), keys.device)
        return now == (self.block_size, self.pooling, self.shape, self.dtype, self.device)

    def _reserve(self, n_blocks: int) -> None:
        have = (self.sums if self.sums is not None else self.maxes).shape[2]
        if n_blocks <= have:
            return
        grow = max(n_blocks, 2 * have) - have  # amortized doubling: no realloc per block
        if self.sums is not None:
            self.sums = F.pad(self.sums, (0, 0, 0, grow))
        if self.maxes is not None:
            self.maxes = F.pad(self.maxes, (0, 0, 0, grow), value=float("-inf"))

    def append(self, keys: torch.Tensor, real: torch.Tensor | None) -> None:
        """Add new cache tokens keys [B, Hkv, T, D]; real [B, T] bool marks non-pad tokens (None: all real)."""
        t = keys.shape[2]
        if t == 0:
            return
        if real is not None and bool(real.all()):
            real = None
        if real is None and t == 1 and self.sums is not None and self.maxes is None:
            # one new token per row (decode, rows of any length): a single indexed add
            rows = torch.arange(keys.shape[0], device=keys.device)
            blocks = self.counts // self.block_size
            self._reserve(int(blocks.max()) + 1)
            self.sums[rows, :, blocks] += keys[:, :, 0].to(self.dtype)
        elif real is None and bool((self.counts == self.counts[0]).all()):
            self._accumulate(slice(None), keys, int(self.counts[0]))
        else:
            for row in range(keys.shape[0]):
                x = keys[row : row + 1] if real is None else keys[row : row + 1, :, real[row]]
                if x.shape[2]:
                    self._accumulate(slice(row, row + 1), x, int(self.counts[row]))
        new_real = torch.full_like(self.counts, t) if real is None else real.sum(-1)
        if real is None:
            first_new = torch.zeros_like(self.counts)
        else:
            first_new = torch.where(real.any(-1), real.to(torch.int8).argmax(-1), t)
        self.starts = torch.where(self.counts == 0, self.n + first_new, self.starts)
        self.counts = self.counts + new_real
        self.n += t

    def _accumulate(self, rows: slice, x: torch.Tensor, count: int) -> None:
        """Add x [b, Hkv, r, D], the real tokens count .. count + r - 1 of `rows`, into their blocks."""
        bs, r = self.block_size, x.shape[2]
        first, off = divmod(count, bs)
        n_blk = -(-(off + r) // bs)
        self._reserve(first + n_blk)
        x = x.to(self.dtype)
        features = gate_features(x, self.pooling)  # what the maxima run over
        if n_blk == 1:  # decode: one token into one block, no padding
            if self.sums is not None:
                self.sums[rows, :, first] += x.sum(2)
            if self.maxes is not None:
                self.maxes[rows, :, first] = torch.maximum(self.maxes[rows, :, first], features.amax(2))
            return
        # index by block instead of padding to whole blocks: memory follows the tokens, not block_size
        block = (count + torch.arange(r, device=x.device)) // bs
        if self.sums is not None:
            self.sums[rows] = self.sums[rows].index_add(2, block, x)
        if self.maxes is not None:
            index = block.view(1, 1, r, 1).expand(*features.shape)
            self.maxes[rows] = self.maxes[rows].scatter_reduce(2, index, features, "amax")

    def block_keys(self, n_blocks: int | None = None) -> torch.Tensor:
        """Pooled keys [B, Hkv, n_blocks, D (2D for mean+max and bound)] in each row's sequence layout."""
        bs = self.block_size
        nb = -(-int(self.counts.max()) // bs) if n_blocks is None else n_blocks
        pooled = []
        if self.sums is not None:
            filled = (self.counts[:, None] - torch.arange(nb, device=self.device) * bs).clamp(0, bs)
            pooled.append(self.sums[:, :, :nb] / filled.clamp(min=1).to(self.dtype)[:, None, :, None])
        if self.maxes is not None:
            maxes = self.maxes[:, :, :nb]
            pooled.append(torch.where(torch.isinf(maxes), 0.0, maxes))  # empty (future) blocks: never selected
        return pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=-1)

    def contiguous_rows(self) -> bool:
        """Every row's real tokens run without a gap to the end of the cache (left padding at most)."""
        return bool((self.starts + self.counts == self.n).all())


def block_state(
    cache: Any,
    layer_idx: int,
    keys: torch.Tensor,
    in_step: bool,
    padding_mask: torch.Tensor | None,
    config: MobaConfig,
    *,
    create: bool = True,
) -> BlockState | None:
    """This layer's state, synced to `keys` (the cache after this call's update): appended to if it was
    `in_step` (it covered exactly the cache before the update), rebuilt from all keys otherwise.
    padding_mask: [B, Nk] bool or None. With create=False a missing or stale state is not (re)built."""
    states = getattr(cache, _STATE_ATTR, None)
    if states is None:
        if not create:
            return None
        states = {}
        setattr(cache, _STATE_ATTR, states)
    state = states.get(layer_idx)
    if state is None and not create:
        return None
    nk = keys.shape[2]
    fresh = state is not None and state.matches(keys, config.block_size, config.pooling) and in_step and state.n <= nk
    if not fresh and not create:  # stale and not needed now: rebuild lazily at the next decode step
        del states[layer_idx]
        return None
    if not fresh:
        if state is not None:
            logger.debug("moba_hf: layer %s block state out of date; rebuilding from %d cached keys", layer_idx, nk)
        state = BlockState(keys, config.block_size, config.pooling)
        states[layer_idx] = state
    real = None if padding_mask is None else padding_mask[:, state.n : nk]
    state.append(keys[:, :, state.n :], real)
    state.keys_ref = weakref.ref(keys)
    return state


# --- the cached step ---------------------------------------------------------------------------------------------
def _step_crossover(cache: Any, query: torch.Tensor, key: torch.Tensor, config: MobaConfig) -> int:
    """`decode_crossover` for a decode step, looked up once per forward: the layers of a forward share the cache
    length, the config and (in the models "moba" runs) the heads, dtype and device, and so the answer."""
    step = (key.shape[2], config, query.shape, key.shape[1], query.dtype, query.device, torch.get_num_threads())
    memo = getattr(cache, _STEP_ATTR, None)
    if memo is None or memo[0] != step:
        crossover = decode_crossover(query, key, block_size=config.block_size, top_k=config.top_k, gate=config.gate)
        memo = (step, crossover)
        setattr(cache, _STEP_ATTR, memo)
    return memo[1]


def cached_step(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding_mask: torch.Tensor | None,
    config: MobaConfig,
    scale: float | None,
) -> torch.Tensor | str | None:
    """Sparse decode for a MoBA layer with a cache: [B, Hq, Nq, D]; DENSE_STEP when the cache has fewer blocks
    than `decode_crossover` (a dense step is cheaper there, and attends a superset of MoBA's blocks); or None to
    run the ordinary path.

    Only with decode="moba", Nq <= DECODE_MAX_QUERIES new queries, every row's real tokens contiguous and
    all new tokens real (what `generate` does, left padding included). Otherwise the block state, if the
    layer has one, is just kept in step.
    """
    call = current_call(module)
    if call is None:
        install_hooks(module)  # nothing to do once installed; hooks take effect from the next forward
        return None
    if padding_mask is not None and padding_mask.dtype != torch.bool:  # packed document ids: never with a cache
        padding_mask = None
    cache, in_step = call
    layer = getattr(module, "layer_idx", None)
    checked = getattr(cache, _CHECKED_ATTR, None)
    if checked is None or layer not in checked:  # once per cache and layer: the kind of a cache's layers is fixed
        check_cache_supported(cache, layer)
        setattr(cache, _CHECKED_ATTR, (checked or frozenset()) | {layer})
    nq, nk = query.shape[2], key.shape[2]
    decode = config.decode == "moba" and nq < nk and nq <= DECODE_MAX_QUERIES and layer is not None
    decode = decode and not config.tail_queries(nq)  # a dense tail runs on the prefill path
    crossover = 0  # measured only for decode steps: prefill and dense calls never pay for it
    if decode:
        crossover = _step_crossover(cache, query, key, config)
    if decode and -(-nk // config.block_size) < crossover:
        # a dense step for sure (no row holds more than nk tokens): no block state is built for it; one built
        # earlier stays in step, and the first sparse step builds one from the cache
        block_state(cache, layer, key, in_step, padding_mask, config, create=False)
        return DENSE_STEP
    state = block_state(cache, layer, key, in_step, padding_mask, config, create=decode) if layer is not None else None
    if not decode or state is None or not state.contiguous_rows() or bool((state.counts < nq).any()):
        return None
    if -(-int(state.counts.max()) // config.block_size) < crossover:
        return DENSE_STEP
    out, selected = moba_decode(
        query, key, value, state.block_keys(), scale=scale, starts=state.starts, return_selection=True,
        **config.kernel_kwargs(),
    )  # fmt: skip
    if sparsity.tracking():
        attended = sum(
            sparsity.attended_pairs(selected[r : r + 1], int(state.counts[r]), config.block_size)
            for r in range(query.shape[0])
        )
        causal = sum(sparsity.causal_pairs(query.shape[1], nq, int(c)) for c in state.counts.tolist())
        sparsity.record(layer, attended, causal, "decode")
    return out
