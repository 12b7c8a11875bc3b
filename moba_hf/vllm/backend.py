"""The MoBA attention backend for vLLM's V1 engine (CPU).

It is vLLM's CPU backend plus MoBA: the KV cache layout, the cache writes (`do_kv_cache_update`) and every
dense computation are vLLM's own; what changes is the attention of the tokens MoBA covers:

    layer dense (full_attn_layers / ids) or sparse = false  ->  vLLM's CPU kernel, the whole batch
    prefill tokens (a prompt, a chunk, a prompt after a cached prefix)  ->  moba_attention per sequence
    decode tokens (one new token): decode = "full"  ->  vLLM's CPU kernel on the decode rows only
                                   decode = "moba"  ->  the gate over pooled keys kept beside the pages
                                                       (`paged.PagedGateKeys`), then only the selected
                                                       blocks, at every step whatever the sequence length

With Dual Chunk Attention every layer and token runs per sequence (`paged.moba_paged` with `PagedDca`):
`do_kv_cache_update` moves the new keys to ``p mod s`` before vLLM's cache write, and `forward` moves the
queries the same way; dense layers and decode = "full" get dense DCA, the others DCA + MoBA.

Without a MoBA config (see `settings`) every layer is vLLM's CPU backend, unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, NamedTuple

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from ..config import MobaConfig
from . import settings
from .paged import PagedDca, PagedGateKeys, dense_decodes, moba_paged

logger = logging.getLogger("moba_hf")
_described: set[str] = set()


@dataclasses.dataclass
class MobaAttentionMetadata(CPUAttentionMetadata):
    # host copies, read once per step by every layer
    query_start_list: list[int] = dataclasses.field(default_factory=list)
    seq_len_list: list[int] = dataclasses.field(default_factory=list)
    # decode steps that run dense on vLLM's kernel (decode = "full")
    dense_decodes: frozenset[int] = frozenset()  # their sequence indices
    all_dense_decodes: bool = False  # the whole batch is such steps: vLLM's kernel runs it as it is
    # in a batch that mixes them with other tokens: those rows alone, for vLLM's kernel
    decode_rows: torch.Tensor | None = None  # token indices of the one-token queries
    decode_metadata: CPUAttentionMetadata | None = None
    # DCA: (tokens,) how far each new token's q / k move (to p mod s); None when none moves
    dca_delta: torch.Tensor | None = None


class Setup(NamedTuple):
    config: MobaConfig
    dense: frozenset[int]  # layer indices of full attention
    dca: PagedDca | None


def _setup(vllm_config: VllmConfig) -> Setup | None:
    found = settings.resolve(vllm_config)
    if found is None:
        return None
    config, serving, where = found
    dense = settings.check(vllm_config, config, serving, where)
    dca = settings.dca_setup(vllm_config, config, where)
    if where not in _described:
        _described.add(where)
        logger.warning(settings.describe(config, dense, where, dca))
    return Setup(config, dense, dca)


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU cache (num_pages, kv_heads, page, 2 * D) holds, per page and head, the keys as (D, page)
    then the values as (page, D): views (num_pages, kv_heads, D, page) and (num_pages, kv_heads, page, D)."""
    num_pages, num_kv_heads, page, double = kv_cache.shape
    d = double // 2
    pairs = kv_cache.view(num_pages, num_kv_heads, 2, page * d)
    return pairs[:, :, 0].unflatten(-1, (d, page)), pairs[:, :, 1].unflatten(-1, (page, d))


def check_cache_layout(isa: str, dtype: torch.dtype, page: int, head_dim: int) -> None:
    """Refuse at startup a CPU cache layout `cache_views` does not read: write known keys and values through
    vLLM's own cache-update op into a two-page scratch cache and read them back."""
    from vllm import _custom_ops as ops

    from .paged import gather_sequence

    n = page + page // 2  # crosses a page boundary
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(n, 1, head_dim, generator=gen).to(dtype) for _ in range(2))
    kv_cache = torch.zeros(3, 1, page, 2 * head_dim, dtype=dtype)
    k_view, v_view = kv_cache.view(3, 1, page * 2, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, k_view, v_view, torch.arange(n) + page, isa)
    key_cache, value_cache = cache_views(kv_cache)
    pages = torch.tensor([1, 2])
    got_k = gather_sequence(key_cache, pages, n, transposed=True)
    got_v = gather_sequence(value_cache, pages, n)
    if not (torch.equal(got_k, key.transpose(0, 1)) and torch.equal(got_v, value.transpose(0, 1))):
        raise settings.MobaSetupError(
            f"moba_hf: vLLM's CPU KV cache layout for isa={isa!r}, dtype={dtype} is not one the MoBA plugin reads "
            "(it reads the 'vec' / 'vec16' layouts: float32 everywhere, 16-bit dtypes without AMX)"
        )


class MobaAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig, device: Any) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        setup = _setup(vllm_config)
        self.moba = setup.config if setup is not None else None
        self.dca = setup.dca if setup is not None else None
        if self.moba is not None:
            check_cache_layout(self.isa, self.dtype, self.block_size, self.head_dim)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> CPUAttentionMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.moba is None or self.is_cross_attention or self.is_encoder_only_attention:
            return base
        common = common_attn_metadata
        starts = common.query_start_loc_cpu[: common.num_reqs + 1].tolist()
        lens = common.seq_lens[: common.num_reqs].cpu().tolist()
        query_lens = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
        meta = MobaAttentionMetadata(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
        meta.query_start_list, meta.seq_len_list = starts, lens
        if self.dca is not None:  # every token runs per sequence: no decode sub-batch for vLLM's kernel
            delta = self.dca.deltas(starts, lens)
            meta.dca_delta = delta if bool(delta.any()) else None
            return meta
        decodes = dense_decodes(query_lens, self.moba)
        meta.dense_decodes = frozenset(decodes)
        meta.all_dense_decodes = len(decodes) == common.num_reqs
        if decodes and len(decodes) < common.num_reqs:
            idx = torch.tensor(decodes, dtype=torch.long)
            rows = torch.tensor([starts[i] for i in decodes], dtype=torch.long)
            qsl = torch.arange(len(decodes) + 1, dtype=common.query_start_loc.dtype)
            sub = dataclasses.replace(
                common,
                query_start_loc=qsl,
                query_start_loc_cpu=qsl,
                seq_lens=common.seq_lens[idx],
                num_reqs=len(decodes),
                num_actual_tokens=len(decodes),
                max_query_len=1,
                max_seq_len=max(lens[i] for i in decodes),
                block_table_tensor=common.block_table_tensor[idx],
                slot_mapping=common.slot_mapping[rows],
            )
            meta.decode_rows = rows
            meta.decode_metadata = super().build(0, sub, fast_build)
        return meta


class MobaAttentionImpl(CPUAttentionBackendImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        layer_idx: int | None = None,
        dual_chunk_attention_config: dict[str, Any] | None = None,
    ) -> None:
        # layer_idx, dual_chunk_attention_config: what vLLM's Qwen2 layers pass with a dual_chunk_attention_config
        # (for vLLM's former DCA backend); `settings` reads that block from the model config itself
        super().__init__(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
            logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks,
        )  # fmt: skip
        vllm_config = get_current_vllm_config()
        setup = _setup(vllm_config) if attn_type == AttentionType.DECODER else None
        self.moba = setup.config if setup is not None else None
        self.dense_layers = setup.dense if setup is not None else frozenset()
        self.dca = setup.dca if setup is not None else None
        if self.moba is not None:
            unsupported = {
                "sliding_window": sliding_window,
                "alibi_slopes": alibi_slopes,
                "logits_soft_cap": logits_soft_cap or None,
                "attention sinks": sinks,
            }
            present = [name for name, value in unsupported.items() if value is not None]
            if present:
                raise settings.MobaSetupError(
                    f"moba_hf: this model's attention uses {', '.join(present)}, which MoBA does not implement"
                )
            from vllm.platforms import current_platform

            if not current_platform.is_cpu():
                raise settings.MobaSetupError(
                    "moba_hf: the vLLM MoBA backend runs on CPU only in this version (its dense parts are vLLM's "
                    f"CPU kernels); this platform is {current_platform.device_name}"
                )
        self._layer_dense: bool | None = None
        self._gate_keys: tuple[int, PagedGateKeys] | None = None  # (the cache's data_ptr, its pooled keys)

    def _sparse_decode(self, layer: Any) -> bool:
        # decode = "moba" on a MoBA layer: the pooled keys beside the cache are kept in step with it
        return self.moba is not None and self.moba.decode == "moba" and self.dca is None and not self._dense(layer)

    def _gate_keys_for(self, kv_cache: torch.Tensor) -> PagedGateKeys:
        if self._gate_keys is None or self._gate_keys[0] != kv_cache.data_ptr():
            # first write, or a cache vLLM allocated anew (after its profiling run): nothing in it yet
            pooled = PagedGateKeys(cache_views(kv_cache)[0], self.moba.block_size, self.moba.pooling)
            self._gate_keys = (kv_cache.data_ptr(), pooled)
        return self._gate_keys[1]

    def _dense(self, layer: Any) -> bool:
        if self._layer_dense is None:
            index = extract_layer_index(layer.layer_name)
            self._layer_dense = index in self.dense_layers or not self.moba.sparse
        return self._layer_dense

    def do_kv_cache_update(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        if self.dca is not None:
            delta = _dca_delta(layer)
            if delta is not None:  # keys enter the cache at p mod s, once
                key = self.dca.move(key, delta)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if self._sparse_decode(layer):
            slots = slot_mapping[: key.shape[0]].long()
            pages = torch.unique(slots[slots >= 0] // kv_cache.shape[2])
            if pages.numel():
                self._gate_keys_for(kv_cache).update(cache_views(kv_cache)[0], pages)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (
            self.moba is None
            or not isinstance(attn_metadata, MobaAttentionMetadata)
            or output_scale is not None
            or output_block_scale is not None
            or (self.dca is None and self._dense(layer))
        ):
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        meta = attn_metadata
        if self.dca is not None:
            return self._forward_dca(layer, query, key, value, kv_cache, meta, output)
        if meta.all_dense_decodes:
            return super().forward(layer, query, key, value, kv_cache, meta, output)
        if meta.decode_metadata is not None:  # dense decode steps in a mixed batch: through vLLM's kernel
            rows = meta.decode_rows
            part = output.new_empty((rows.numel(), *output.shape[1:]))
            super().forward(layer, query[rows], key[rows], value[rows], kv_cache, meta.decode_metadata, part)
            output[rows] = part
        key_cache, value_cache = cache_views(kv_cache)
        moba_paged(
            query,
            key,
            value,
            key_cache,
            value_cache,
            output,
            query_start_loc=meta.query_start_list,
            seq_lens=meta.seq_len_list,
            block_table=meta.block_table,
            config=self.moba,
            scale=self.scale,
            skip=meta.dense_decodes,
            gate_keys=self._gate_keys_for(kv_cache) if self._sparse_decode(layer) else None,
        )
        return output

    def _forward_dca(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: MobaAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        if meta.dca_delta is not None:  # the same move do_kv_cache_update gave the keys in the cache
            query, key = self.dca.move(query, meta.dca_delta), self.dca.move(key, meta.dca_delta)
        key_cache, value_cache = cache_views(kv_cache)
        moba_paged(
            query, key, value, key_cache, value_cache, output, query_start_loc=meta.query_start_list,
            seq_lens=meta.seq_len_list, block_table=meta.block_table, config=self.moba, scale=self.scale,
            dense=self._dense(layer), dca=self.dca,
        )  # fmt: skip
        return output


def _dca_delta(layer: Any) -> torch.Tensor | None:
    """This step's DCA moves for `layer`, from the metadata vLLM put in the forward context (vLLM's cache
    write gets no metadata); None when there is none (warm-up runs) or nothing moves."""
    if not is_forward_context_available():
        return None
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):  # speculative decoding: [0] is the base model's
        meta = meta[0] if meta else None
    if isinstance(meta, dict):
        meta = meta.get(layer.layer_name)
    return meta.dca_delta if isinstance(meta, MobaAttentionMetadata) else None


class MobaAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with MoBA for the layers and tokens a MobaConfig makes sparse."""

    @staticmethod
    def get_impl_cls() -> type[MobaAttentionImpl]:
        return MobaAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[MobaAttentionMetadataBuilder]:
        return MobaAttentionMetadataBuilder
