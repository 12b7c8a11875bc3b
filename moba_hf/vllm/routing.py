"""What the CPU and GPU MoBA backends share: the attention plan (`startup.Setup.plan`), the metadata added to
vLLM's, the routing of each layer and token, the DCA moves. Each backend (`cpu_backend` over vLLM's CPU backend,
`gpu_backend` over its Triton backend) is a subclass of vLLM's classes with these mixins first and a cache layout
function (`layouts`)::

    layer dense (full_attn_layers / ids) or sparse = false  ->  vLLM's kernel, the whole batch
    prefill tokens (a prompt, a chunk, a prompt after a cached prefix)  ->  moba_attention per sequence
    decode tokens (one new token): decode = "full"  ->  vLLM's kernel on the decode rows only
                                   decode = "moba"  ->  the gate over pooled keys kept beside the pages
                                                       (`paged.PagedGateKeys`), then only the selected
                                                       blocks, at every step whatever the sequence length

With Dual Chunk Attention every layer and token runs per sequence (`paged.moba_paged` with `ServedDca`):
`do_kv_cache_update` moves the new keys to ``p mod s`` before vLLM's cache write, and `forward` moves the
queries the same way; dense layers and decode = "full" get dense DCA, the others DCA + MoBA.

Without a MoBA config (see `startup`) every layer is vLLM's backend, unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata

from . import startup
from .layouts import Layout
from .paged import PagedGateKeys, ServedDca, dense_decodes, moba_paged


def platform_kind() -> str:
    """'cpu', 'cuda' (NVIDIA) or the platform's device name: what `MobaImplMixin.platform` is compared with."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    return "cuda" if current_platform.is_cuda() else str(current_platform.device_name)


@dataclasses.dataclass
class MobaFields:
    """The fields a MoBA backend adds to its vLLM metadata class (`class M(MobaFields, VllmMetadata)`)."""

    # host copies, read once per step by every layer
    query_start_list: list[int] = dataclasses.field(default_factory=list)
    seq_len_list: list[int] = dataclasses.field(default_factory=list)
    # decode steps that run dense on vLLM's kernel (decode = "full")
    dense_decodes: frozenset[int] = frozenset()  # their sequence indices
    all_dense_decodes: bool = False  # the whole batch is such steps: vLLM's kernel runs it as it is
    # in a batch that mixes them with other tokens: those rows alone, for vLLM's kernel
    decode_rows: torch.Tensor | None = None  # token indices of the one-token queries, on the batch's device
    decode_metadata: Any = None  # vLLM's own metadata of those rows
    # DCA: (tokens,) how far each new token's q / k move (to p mod s); None when none moves
    dca_delta: torch.Tensor | None = None


class MobaBuilderMixin:
    """Before a vLLM metadata builder: its metadata plus `MobaFields` (host lists, the dense-decode sub-batch,
    DCA moves) when a MoBA config is found. Subclasses set `metadata_cls`."""

    metadata_cls: ClassVar[type]

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig, device: Any) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        found = startup.setup(vllm_config)
        self.plan = found.plan if found is not None else None  # None: no MoBA config, vLLM's backend alone
        self.dca = found.dca if found is not None else None
        if self.plan is not None:
            self.check_layout()

    def check_layout(self) -> None:
        """Refuse at startup a cache layout the backend's layout function does not read (none by default)."""

    def moba_applies(self) -> bool:
        """False for the attention kinds vLLM's kernel runs alone (cross, encoder-only)."""
        return not (getattr(self, "is_cross_attention", False) or getattr(self, "is_encoder_only_attention", False))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if self.plan is None or not self.moba_applies():
            return base
        common = common_attn_metadata
        starts = common.query_start_loc_cpu[: common.num_reqs + 1].tolist()
        lens = common.seq_lens[: common.num_reqs].cpu().tolist()
        query_lens = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
        meta = self.metadata_cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})
        meta.query_start_list, meta.seq_len_list = starts, lens
        if self.dca is not None:  # every token runs per sequence: no decode sub-batch for vLLM's kernel
            delta = self.dca.deltas(starts, lens)
            meta.dca_delta = delta.to(common.query_start_loc.device) if bool(delta.any()) else None
            return meta
        decodes = dense_decodes(query_lens, self.plan)
        meta.dense_decodes = frozenset(decodes)
        meta.all_dense_decodes = len(decodes) == common.num_reqs
        if decodes and len(decodes) < common.num_reqs:
            meta.decode_rows, sub = decode_sub_batch(common, decodes, starts, lens)
            meta.decode_metadata = super().build(0, sub, fast_build)
        return meta


def decode_sub_batch(
    common: CommonAttentionMetadata, decodes: list[int], starts: list[int], lens: list[int]
) -> tuple[torch.Tensor, CommonAttentionMetadata]:
    """The token rows of the one-token sequences `decodes` and vLLM's common metadata of those rows alone."""
    device = common.query_start_loc.device
    idx = torch.tensor(decodes, dtype=torch.long, device=device)
    rows = torch.tensor([starts[i] for i in decodes], dtype=torch.long, device=device)
    qsl_cpu = torch.arange(len(decodes) + 1, dtype=common.query_start_loc_cpu.dtype)
    sub = dataclasses.replace(
        common,
        query_start_loc=qsl_cpu.to(device=device, dtype=common.query_start_loc.dtype),
        query_start_loc_cpu=qsl_cpu,
        seq_lens=common.seq_lens[idx],
        num_reqs=len(decodes),
        num_actual_tokens=len(decodes),
        max_query_len=1,
        max_seq_len=max(lens[i] for i in decodes),
        block_table_tensor=common.block_table_tensor[idx],
        slot_mapping=common.slot_mapping[rows],
    )
    return rows, sub


class MobaImplMixin:
    """Before a vLLM attention impl: MoBA / DCA for the layers and tokens the config makes sparse, vLLM's kernel
    (`super()`) for the rest. Subclasses set `layout` (their cache's views) and `platform` (`platform_kind`)."""

    layout: ClassVar[Layout]
    platform: ClassVar[str]

    def __init__(
        self, *args: Any, layer_idx: int | None = None, dual_chunk_attention_config: Any = None, **kwargs: Any
    ) -> None:
        # layer_idx, dual_chunk_attention_config: what vLLM's Qwen2 layers pass with a dual_chunk_attention_config
        # (for vLLM's former DCA backend); `startup` reads that block from the model config itself
        super().__init__(*args, **kwargs)
        given = inspect.signature(super().__init__).bind(*args, **kwargs)
        given.apply_defaults()
        arg = given.arguments
        window = arg["sliding_window"]
        if arg.get("chunk_lookback", -1) != -1:  # chunked local attention (Triton's) is a window too
            window = f"chunk_lookback={arg['chunk_lookback']}"
        self.moba_init(arg["attn_type"], window, arg["alibi_slopes"], arg["logits_soft_cap"], arg["sinks"])

    def moba_init(
        self, attn_type: str, sliding_window: Any, alibi_slopes: Any, logits_soft_cap: Any, sinks: Any
    ) -> None:
        """After vLLM's __init__: this layer's config, and the refusals that need the layer's arguments."""
        found = startup.setup(get_current_vllm_config()) if attn_type == AttentionType.DECODER else None
        self.plan = found.plan if found is not None else None  # None: no MoBA config, vLLM's backend alone
        self.dca = found.dca if found is not None else None
        if self.plan is not None:
            unsupported = {
                "sliding_window": sliding_window,
                "alibi_slopes": alibi_slopes,
                "logits_soft_cap": logits_soft_cap or None,
                "attention sinks": sinks,
            }
            present = [name for name, value in unsupported.items() if value is not None]
            if present:
                raise startup.MobaSetupError(
                    f"moba_hf: this model's attention uses {', '.join(present)}, which MoBA does not implement"
                )
            here = platform_kind()
            if here != self.platform:
                raise startup.MobaSetupError(
                    f"moba_hf: {type(self).__name__} runs on the {self.platform} platform (its dense parts are "
                    f"vLLM's {self.platform} kernels); this platform is {here}"
                )
        self._index: int | None = None  # this layer's index in the model (from its name, on first use)
        self._gate_keys: tuple[int, PagedGateKeys] | None = None  # (the cache's data_ptr, its pooled keys)

    def _sparse_decode(self, layer: Any) -> bool:
        # decode = "moba" on a MoBA layer: the pooled keys beside the cache are kept in step with it
        return self.plan is not None and self.plan.sparse_decode(self._layer_index(layer))

    def _gate_keys_for(self, kv_cache: torch.Tensor) -> PagedGateKeys:
        if self._gate_keys is None or self._gate_keys[0] != kv_cache.data_ptr():
            # first write, or a cache vLLM allocated anew (after its profiling run): nothing in it yet
            key_cache = type(self).layout(kv_cache)[0]
            self._gate_keys = (kv_cache.data_ptr(), PagedGateKeys(key_cache, self.plan.block_size, self.plan.pooling))
        return self._gate_keys[1]

    def _dca_on(self, device: torch.device) -> ServedDca:
        # the RoPE frequencies on the cache's device (startup reads them on the CPU)
        if self.dca.inv_freq.device != device:
            self.dca = dataclasses.replace(self.dca, inv_freq=self.dca.inv_freq.to(device))
        return self.dca

    def _layer_index(self, layer: Any) -> int:
        if self._index is None:
            self._index = extract_layer_index(layer.layer_name)
        return self._index

    def _dense(self, layer: Any) -> bool:
        return self.plan.dense_layer(self._layer_index(layer))

    def do_kv_cache_update(
        self, layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        if self.plan is not None and self.dca is not None:
            delta = dca_delta(layer)
            if delta is not None:  # keys enter the cache at p mod s, once
                key = self._dca_on(key.device).move(key, delta)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        if self._sparse_decode(layer):
            key_cache = type(self).layout(kv_cache)[0]
            slots = slot_mapping[: key.shape[0]].long()
            pages = torch.unique(slots[slots >= 0] // key_cache.shape[2])
            if pages.numel():
                self._gate_keys_for(kv_cache).update(key_cache, pages)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (
            self.plan is None
            or not isinstance(attn_metadata, MobaFields)
            or output_scale is not None
            or output_block_scale is not None
            or (self.dca is None and self._dense(layer))
        ):
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        meta = attn_metadata
        key_cache, value_cache = type(self).layout(kv_cache)
        paged = dict(
            query_start_loc=meta.query_start_list,
            seq_lens=meta.seq_len_list,
            block_table=meta.block_table,
            plan=self.plan,
            scale=self.scale,
        )
        if self.dca is not None:
            dca = self._dca_on(query.device)
            if meta.dca_delta is not None:  # the same move do_kv_cache_update gave the keys in the cache
                query, key = dca.move(query, meta.dca_delta), dca.move(key, meta.dca_delta)
            moba_paged(query, key, value, key_cache, value_cache, output, **paged, dense=self._dense(layer), dca=dca)
            return output
        if meta.all_dense_decodes:
            return super().forward(layer, query, key, value, kv_cache, meta, output)
        if meta.decode_metadata is not None:  # dense decode steps in a mixed batch: through vLLM's kernel
            rows = meta.decode_rows
            part = output.new_empty((rows.numel(), *output.shape[1:]))
            super().forward(layer, query[rows], key[rows], value[rows], kv_cache, meta.decode_metadata, part)
            output[rows] = part
        gate_keys = self._gate_keys_for(kv_cache) if self._sparse_decode(layer) else None
        moba_paged(
            query, key, value, key_cache, value_cache, output, **paged, skip=meta.dense_decodes, gate_keys=gate_keys
        )
        return output


def dca_delta(layer: Any) -> torch.Tensor | None:
    """This step's DCA moves for `layer`, from the metadata vLLM put in the forward context (vLLM's cache
    write gets no metadata); None when there is none (warm-up runs) or nothing moves."""
    if not is_forward_context_available():
        return None
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):  # speculative decoding: [0] is the base model's
        meta = meta[0] if meta else None
    if isinstance(meta, dict):
        meta = meta.get(layer.layer_name)
    return meta.dca_delta if isinstance(meta, MobaFields) else None


class MobaBackendMixin:
    """Before a vLLM attention backend class: its impl and metadata builder are the MoBA ones the subclass names."""

    impl_cls: ClassVar[type]
    builder_cls: ClassVar[type]

    @classmethod
    def get_impl_cls(cls) -> type:
        return cls.impl_cls

    @classmethod
    def get_builder_cls(cls) -> type:
        return cls.builder_cls


__all__ = [
    "MobaBackendMixin",
    "MobaBuilderMixin",
    "MobaFields",
    "MobaImplMixin",
    "dca_delta",
    "decode_sub_batch",
    "platform_kind",
]
