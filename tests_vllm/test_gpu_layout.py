"""The GPU backend's path without a GPU: paged MoBA and DCA over vLLM's Triton / FlashAttention cache layout, in
every physical axis order vLLM allocates, against the kernels per sequence; the GPU impl's own cache write and
forward on CPU tensors.

vLLM's CPU build replaces Triton with a placeholder (its `triton_utils`), so its Triton kernels cannot run here;
these tests stand in for exactly two of them, with what `TritonAttentionImpl` asks of them: the cache write
(`triton_reshape_and_cache_flash`: each new key and value into (page, offset) of the (pages, page, heads, D)
views the impl makes) and the dense attention (`TritonAttentionImpl.forward`: causal attention of each sequence's
queries over its pages, from its metadata). Everything else is vLLM's own classes.
"""

from __future__ import annotations

import paged_cases
import pytest
import torch
from engines import MAX_MODEL_LEN
from paged_cases import HKV, PAGE, QUERY_LENS, SEQ_LENS, D, slots_of
from server_helpers import model_path
from vllm.v1.attention.backends import triton_attn
from vllm.v1.kv_cache_layout import KVCacheLayout

from moba_hf import MobaConfig, causal_attention
from moba_hf.vllm import gpu_backend, layouts, routing, startup
from moba_hf.vllm.layouts import flash_layout
from moba_hf.vllm.paged import PagedGateKeys, gather_sequence

# physical axis orders of one layer's logical (num_pages, kv_heads, page, 2 * D) cache, one per vLLM layout
ORDERS = sorted({layout.layer_view_order for layout in KVCacheLayout})
ORDER_IDS = ["".join("BHNC"[i] for i in order) for order in ORDERS]


def triton_cache(order, heads=HKV, dtype=torch.float32):
    """An empty cache factory: logical (num_pages, heads, PAGE, 2 * D), stored in physical axis order `order`."""

    def empty(num_pages):
        logical = (num_pages, heads, PAGE, 2 * D)
        return torch.zeros([logical[i] for i in order], dtype=dtype).permute(*[order.index(i) for i in range(4)])

    return empty


def triton_write(kv_cache, k, v, slots):
    """`triton_reshape_and_cache_flash` as `TritonAttentionImpl.do_kv_cache_update` calls it: into the views
    (num_pages, page, heads, D) of the cache's first and second halves of the last axis."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(kv_cache.shape[-1] // 2, dim=-1)
    slots = slots.long()
    keep = slots >= 0  # -1: a padding token vLLM does not write
    page, offset = slots[keep] // kv_cache.shape[2], slots[keep] % kv_cache.shape[2]
    key_cache[page, offset] = k[: slots.shape[0]][keep].to(key_cache.dtype)
    value_cache[page, offset] = v[: slots.shape[0]][keep].to(value_cache.dtype)


def flash_cache(num_pages):
    return torch.zeros(num_pages, 2, PAGE, HKV, D)


def flash_write(kv_cache, k, v, slots):
    """The (num_pages, 2, page, kv_heads, D) layout: keys at [page, 0, offset], values at [page, 1, offset]."""
    kv_cache[slots // PAGE, 0, slots % PAGE] = k
    kv_cache[slots // PAGE, 1, slots % PAGE] = v


READERS = {
    **{f"triton-{name}": (triton_cache(order), triton_write, layouts.triton_layout) for name, order in
       zip(ORDER_IDS, ORDERS, strict=True)},
    "flash-5d": (flash_cache, flash_write, flash_layout),
}  # fmt: skip


@pytest.mark.parametrize("config", list(paged_cases.CONFIGS))
@pytest.mark.parametrize("pooled_beside_pages", [False, True], ids=["gathered", "pooled-beside-pages"])
@pytest.mark.parametrize("reader", list(READERS))
def test_mixed_batch_over_gpu_layout_equals_moba_attention_per_sequence(reader, config, pooled_beside_pages):
    empty, write, layout = READERS[reader]
    batch = paged_cases.paged_batch(SEQ_LENS, QUERY_LENS, empty, write)
    paged_cases.check_mixed_batch(paged_cases.CONFIGS[config], batch, layout, pooled_beside_pages=pooled_beside_pages)


@pytest.mark.parametrize("case", list(paged_cases.DCA_CONFIGS))
@pytest.mark.parametrize("order", ORDERS, ids=ORDER_IDS)
def test_paged_dca_over_gpu_layout_equals_dca_per_sequence(order, case):
    paged_cases.check_dca_mixed_batch(case, triton_cache(order), triton_write, layouts.triton_layout)


@pytest.mark.parametrize("order", ORDERS, ids=ORDER_IDS)
def test_triton_layout_is_a_view_of_the_cache(order):
    kv_cache = triton_cache(order)(5)
    key_cache, value_cache = layouts.triton_layout(kv_cache)
    kv_cache[3, 1, 7, :D], kv_cache[3, 1, 7, D:] = 1.0, 2.0
    assert key_cache[3, 1, 7].eq(1).all() and value_cache[3, 1, 7].eq(2).all()
    assert key_cache.sum() == D and value_cache.sum() == 2 * D  # nothing else moved
    assert key_cache.data_ptr() == kv_cache.data_ptr()


@pytest.fixture
def vllm_op(monkeypatch):
    """vLLM's Triton cache write, replaced by its torch equivalent (vLLM's CPU build has no Triton)."""
    from vllm.v1.attention.ops import triton_reshape_and_cache_flash as module

    def cache_write(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
        assert kv_cache_dtype == "auto"
        slots = slot_mapping.long()
        key_cache[slots // key_cache.shape[1], slots % key_cache.shape[1]] = key
        value_cache[slots // value_cache.shape[1], slots % value_cache.shape[1]] = value

    monkeypatch.setattr(module, "triton_reshape_and_cache_flash", cache_write)
    return cache_write


@pytest.mark.parametrize("order", ORDERS, ids=ORDER_IDS)
def test_cache_layout_check_refuses_a_wrong_reader(order, vllm_op, monkeypatch):
    layouts.check_triton_layout(torch.float32, 32, 64, "cpu", order)

    # a reader that takes the page's positions for heads (a reshape where the view needs a transpose) is refused
    def wrong(kv):
        return tuple(x.reshape(x.shape[0], x.shape[2], x.shape[1], -1).transpose(1, 2) for x in kv.split(64, -1))

    monkeypatch.setattr(layouts, "triton_layout", wrong)
    with pytest.raises(startup.MobaSetupError, match="Triton KV cache layout"):
        layouts.check_triton_layout(torch.float32, 32, 64, "cpu", order)
    # keys and values swapped
    monkeypatch.setattr(layouts, "triton_layout", lambda kv: kv.split(64, -1)[::-1])
    with pytest.raises(startup.MobaSetupError, match="Triton KV cache layout"):
        layouts.check_triton_layout(torch.float32, 32, 64, "cpu", order)


# --- the GPU impl itself on CPU tensors: vLLM's Triton builder and impl with the MoBA mixins ----------------------
HQ_M, HKV_M = 9, 3  # the embedded SmolLM2's heads, which vLLM's builder reads from the model config


def dense_triton_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *scales):
    """`TritonAttentionImpl.forward` in torch: causal attention of each sequence's queries over its pages, from
    vLLM's metadata alone (so a wrong decode sub-batch fails)."""
    key_cache, value_cache = kv_cache.split(kv_cache.shape[-1] // 2, dim=-1)
    starts = attn_metadata.query_start_loc.tolist()
    for i, length in enumerate(attn_metadata.seq_lens.tolist()):
        q = query[starts[i] : starts[i + 1]].transpose(0, 1)[None]
        k = gather_sequence(key_cache, attn_metadata.block_table[i], length)[None]
        v = gather_sequence(value_cache, attn_metadata.block_table[i], length)[None]
        output[starts[i] : starts[i + 1]] = causal_attention(q, k, v, scale=self.scale)[0].transpose(0, 1)
    return output


@pytest.fixture
def moba_engine(monkeypatch, vllm_op):
    """A vLLM config with a MoBA config, the CPU platform taken for CUDA by the impl's check, vLLM's two Triton
    kernels in torch (see the module docstring)."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(routing, "platform_kind", lambda: "cuda")
    monkeypatch.setattr(triton_attn.TritonAttentionImpl, "forward", dense_triton_forward)

    def triton_do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        triton_write(kv_cache, key, value, slot_mapping)

    monkeypatch.setattr(triton_attn.TritonAttentionImpl, "do_kv_cache_update", triton_do_kv_cache_update)

    def start(moba: dict):
        args = dict(model=model_path(), dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True)
        vllm_config = EngineArgs(**args, hf_overrides={"moba_config": moba}).create_engine_config()
        vllm_config.cache_config.kv_cache_layout = KVCacheLayout.LBNHC.name  # what the engine core resolves
        return vllm_config, set_current_vllm_config(vllm_config)

    return start


class Layer:
    def __init__(self, index: int) -> None:
        self.layer_name = f"model.layers.{index}.self_attn.attn"


def common_metadata(starts, lens, table, slots):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor(starts, dtype=torch.int32)
    longest = max(b - a for a, b in zip(starts, starts[1:], strict=False))
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
        num_reqs=len(lens), num_actual_tokens=starts[-1], max_query_len=longest,
        max_seq_len=max(lens), block_table_tensor=table, slot_mapping=slots,
    )  # fmt: skip


@pytest.mark.parametrize(
    "moba,layer",
    [
        ({"block_size": 64, "top_k": 2, "decode": "full"}, 0),  # decode rows through vLLM's kernel, in a sub-batch
        ({"block_size": 48, "top_k": 2, "decode": "moba", "pooling": "bound"}, 0),  # pooled keys kept in step
        ({"block_size": 64, "top_k": 2, "full_attn_layer_ids": [1]}, 1),  # a dense layer: vLLM's kernel alone
    ],
    ids=["decodefull", "decodemoba-bound", "dense-layer"],
)
def test_gpu_impl_forward_equals_the_kernels_per_sequence(moba_engine, moba, layer):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    vllm_config, context = moba_engine(moba)
    config = MobaConfig.from_spec(moba)
    with context:
        spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=HKV_M, head_size=D, dtype=torch.float32)
        builder = gpu_backend.MobaTritonAttentionMetadataBuilder(
            spec, ["model.layers.0.self_attn.attn"], vllm_config, torch.device("cpu")
        )
        impl = gpu_backend.MobaTritonAttentionImpl(HQ_M, D, D**-0.5, HKV_M, None, None, "auto")
    assert builder.get_cudagraph_support(vllm_config, spec).name == "NEVER"
    # every write through the impl's cache write: the cached part of each sequence (earlier steps), then this step's
    kv_cache, table, starts, keys, values, query, key, value = paged_cases.paged_batch(
        SEQ_LENS, QUERY_LENS, triton_cache((0, 2, 1, 3), heads=HKV_M), lambda *a: None, hq=HQ_M
    )
    keys = [k.repeat(1, 2, 1)[:, :HKV_M] for k in keys]  # paged_batch draws HKV heads: widen to the model's
    values = [v.repeat(1, 2, 1)[:, :HKV_M] for v in values]
    for i, (n, nq) in enumerate(zip(SEQ_LENS, QUERY_LENS, strict=True)):
        cached = slots_of(table[i], torch.arange(n - nq))
        impl.do_kv_cache_update(Layer(layer), keys[i][: n - nq], values[i][: n - nq], kv_cache, cached)
    key = torch.cat([k[n - nq :] for k, n, nq in zip(keys, SEQ_LENS, QUERY_LENS, strict=True)])
    value = torch.cat([v[n - nq :] for v, n, nq in zip(values, SEQ_LENS, QUERY_LENS, strict=True)])
    new = [torch.arange(n - nq, n) for n, nq in zip(SEQ_LENS, QUERY_LENS, strict=True)]
    slots = torch.cat([slots_of(table[i], positions) for i, positions in enumerate(new)])
    meta = builder.build(0, common_metadata(starts, SEQ_LENS, table, slots))
    assert isinstance(meta, routing.MobaFields) and meta.seq_len_list == SEQ_LENS
    impl.do_kv_cache_update(Layer(layer), key, value, kv_cache, slots)
    if impl._sparse_decode(Layer(layer)):  # the pooled keys kept beside the pages: those of the written cache
        key_cache = layouts.triton_layout(kv_cache)[0]
        full = PagedGateKeys(key_cache, config.block_size, config.pooling)
        full.update(key_cache, torch.arange(kv_cache.shape[0]))
        torch.testing.assert_close(impl._gate_keys[1].stats, full.stats)
    output = torch.full_like(query, float("nan"))
    impl.forward(Layer(layer), query, key, value, kv_cache, meta, output)
    dense = layer in config.full_layer_set(30)
    for i in range(len(SEQ_LENS)):
        q = query[starts[i] : starts[i + 1]].transpose(0, 1)[None]
        k, v = keys[i].transpose(0, 1)[None], values[i].transpose(0, 1)[None]
        want = paged_cases.moba_answer(config, q, k, v, D**-0.5, dense=dense)
        got = output[starts[i] : starts[i + 1]].transpose(0, 1)[None]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"sequence {i}")


# --- registration and the dense GPU backends' refusal -------------------------------------------------------------
def test_register_on_cuda_maps_triton_and_guards(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends import registry
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # before the platform reads as CUDA

    import moba_hf.vllm as plugin

    flash = resolve_obj_by_qualname(plugin.GUARDS["FLASH_ATTN"])
    assert issubclass(flash, FlashAttentionBackend) and flash is not FlashAttentionBackend
    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", {})  # what this register() call adds
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    plugin.register()
    overrides = {backend.name: path for backend, path in registry._ATTN_OVERRIDES.items()}
    assert overrides["TRITON_ATTN"] == overrides["CUSTOM"] == plugin.GPU_BACKEND
    assert {name: overrides[name] for name in plugin.GUARDS} == plugin.GUARDS
    assert "CPU_ATTN" not in overrides
    # the paths name classes that exist (FlashInfer is not installed here)
    assert resolve_obj_by_qualname(plugin.GPU_BACKEND) is gpu_backend.MobaTritonAttentionBackend


def test_guarded_backend_refuses_a_moba_config_only(monkeypatch):
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    from moba_hf.vllm import guards

    monkeypatch.delenv(startup.ENV, raising=False)

    class Dense:
        @classmethod
        def validate_configuration(cls, *args, **kwargs):
            return ["its own reason"]

    guarded = guards.guard(Dense)
    assert guarded.__name__ == "Dense" and issubclass(guarded, Dense)
    args = dict(model=model_path(), dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True)
    with set_current_vllm_config(EngineArgs(**args).create_engine_config()):
        assert guarded.validate_configuration() == ["its own reason"]
    moba = EngineArgs(**args, hf_overrides={"moba_config": {"block_size": 64, "top_k": 2}}).create_engine_config()
    with set_current_vllm_config(moba):
        reasons = guarded.validate_configuration()
    assert reasons[0] == "its own reason" and "TRITON_ATTN" in reasons[1] and len(reasons) == 2


def test_gpu_impl_refuses_a_moba_config_on_another_platform(moba_engine, monkeypatch):
    _, context = moba_engine({"block_size": 64, "top_k": 2})
    monkeypatch.setattr(routing, "platform_kind", lambda: "rocm")
    with context, pytest.raises(startup.MobaSetupError, match="runs on the cuda platform.*this platform is rocm"):
        gpu_backend.MobaTritonAttentionImpl(HQ_M, D, D**-0.5, HKV_M, None, None, "auto")
