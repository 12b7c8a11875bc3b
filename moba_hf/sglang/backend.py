"""The MoBA attention backends for SGLang: `MobaPoolMixin` before an SGLang backend; on CPU SGLang's torch-native
backend plus MoBA (`MobaTorchNativeBackend`), on NVIDIA GPUs its Triton backend (`gpu_backend`).

The KV pool, its writes and the attention of dense layers are SGLang's own; what changes is the attention of
the layers a MobaConfig makes sparse: every sequence of an extend (a prompt, a chunk, a prompt after a
radix-cache hit) or a decode step goes to `core` over its own keys in the pool (`pool.moba_pool`)::

    layer dense (full_attn_layers / ids) or sparse = false  ->  SGLang's torch-native attention
    otherwise, every sequence                               ->  core.route / core.attend over its pool slots
    decode steps with decode = "moba"                       ->  core.decode over the pooled keys kept beside
                                                                the pool (`pool.PoolGateKeys`, one table per
                                                                sparse layer), reading the selected blocks only

With Dual Chunk Attention every layer and token runs per sequence (`serving.ServedDca`): the new keys move from
their plain-RoPE position p to ``p mod s`` before the cache write, the queries the same before they attend; dense
layers, sparse = false and decode = "full" steps get dense DCA, the others DCA + MoBA.

Without a MoBA config (see `startup`) the backend is SGLang's own, unchanged.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from .pool import PoolGateKeys, moba_pool
from .startup import MobaSetupError, Setup


class MobaPoolMixin:
    """Before an SGLang attention backend over a token pool (`token_to_kv_pool`: per layer (slots, kv_heads, D),
    `req_to_token` rows): MoBA / DCA for the layers and tokens a MobaConfig covers, the backend's own attention
    (`super()`) for the rest."""

    def __init__(self, model_runner: Any, setup: Setup) -> None:
        super().__init__(model_runner)
        if getattr(self, "use_sliding_window_kv_pool", False):
            raise MobaSetupError("moba_hf: sliding-window attention cannot be combined with MoBA")
        self.plan = setup.plan  # which keys each query sees, every layer
        self.dca = setup.dca
        self.lists: tuple[list[int], list[int], list[int]] | None = None
        self.dca_delta: torch.Tensor | None = None  # (tokens,) this step's DCA moves; None when none moves
        self.gate_keys: dict[int, tuple[int, PoolGateKeys]] = {}  # layer id -> (its pool's data_ptr, pooled keys)

    def init_forward_metadata(self, forward_batch: Any) -> None:
        super().init_forward_metadata(forward_batch)
        # host copies read by every layer of this step: rows of req_to_token, positions so far, new positions
        rows = forward_batch.req_pool_indices.tolist()
        if forward_batch.seq_lens_cpu is not None:
            lens = forward_batch.seq_lens_cpu.tolist()
        else:
            lens = forward_batch.seq_lens.tolist()
        if forward_batch.forward_mode.is_decode_or_idle():
            new = [1] * len(rows)
        elif forward_batch.extend_seq_lens_cpu is not None:
            new = list(forward_batch.extend_seq_lens_cpu)
        else:
            new = forward_batch.extend_seq_lens.tolist()
        self.lists = (rows, lens, new)
        if self.dca is not None:
            if self.dca.inv_freq.device != forward_batch.seq_lens.device:  # startup reads them on the CPU
                self.dca = dataclasses.replace(self.dca, inv_freq=self.dca.inv_freq.to(forward_batch.seq_lens.device))
            delta = self.dca.deltas([0, *itertools.accumulate(new)], lens)
            self.dca_delta = delta.to(forward_batch.seq_lens.device) if bool(delta.any()) else None

    def dense_layer(self, layer: Any) -> bool:
        """Whether `layer` attends densely: a full-attention layer or sparse = false."""
        return self.plan.dense_layer(layer.layer_id)

    def moba_layer(self, layer: Any) -> bool:
        """Whether `layer` runs here: a sparse layer (with DCA, every layer) of plain causal self-attention."""
        if self.dca is None and self.dense_layer(layer):
            return False
        if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
            return False
        window = layer.sliding_window_size
        if window is not None and window > -1:
            raise MobaSetupError(f"moba_hf: layer {layer.layer_id} uses sliding-window attention ({window})")
        return True

    def gate_keys_for(self, layer: Any, k_buffer: torch.Tensor) -> PoolGateKeys | None:
        """The layer's pooled keys beside the pool with decode = "moba" (None otherwise); new for a new pool."""
        if not self.plan.sparse_decode(layer.layer_id):
            return None
        found = self.gate_keys.get(layer.layer_id)
        if found is None or found[0] != k_buffer.data_ptr():
            found = (k_buffer.data_ptr(), PoolGateKeys(k_buffer, self.plan.block_size, self.plan.pooling))
            self.gate_keys[layer.layer_id] = found
        return found[1]

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if not self.moba_layer(layer):
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.moba_forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if not self.moba_layer(layer):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.moba_forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def moba_forward(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs) -> torch.Tensor:
        given = sorted(name for name, value in kwargs.items() if value is not None)
        if given:  # SGLang's extras for other models (attention sinks, score modifiers)
            raise MobaSetupError(f"moba_hf: layer {layer.layer_id} passes {', '.join(given)}, which MoBA does not take")
        q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if self.dca_delta is not None:  # keys enter the cache at p mod s, once; queries attend from there
            q_ = self.dca.move(q_, self.dca_delta)
            if k is not None:
                k = self.dca.move(k, self.dca_delta)
        if save_kv_cache and k is not None and v is not None:  # SGLang's own cache write
            loc = KVWriteLoc.for_batch(forward_batch, swa_loc=getattr(self, "swa_out_cache_loc", None))
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
        o = q.new_empty((q_.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        rows, lens, new = self.lists
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        moba_pool(
            q_,
            o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
            k_buffer,
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token,
            req_pool_indices=rows,
            seq_lens=lens,
            extend_lens=new,
            plan=self.plan,
            scale=layer.scaling,
            dense=self.dense_layer(layer),
            dca=self.dca,
            gate_keys=self.gate_keys_for(layer, k_buffer),
        )
        return o


class MobaTorchNativeBackend(MobaPoolMixin, TorchNativeAttnBackend):
    """SGLang's torch-native attention backend with MoBA for the layers a MobaConfig makes sparse."""
