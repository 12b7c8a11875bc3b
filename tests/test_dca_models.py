"""DCA inside transformers on tiny Llama / Qwen2 / Qwen3 models: exactness inside one chunk, cached decoding
and chunked prefill against one full forward, keys stored at j mod s, padding, configs and errors."""

import copy
import dataclasses
from pathlib import Path

import pytest
import tiny_models
import torch
from tiny_models import ARCHS
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import rotate_half

import moba_hf
from moba_hf import DcaConfig, MobaConfig
from moba_hf.dca.config import DcaParams
from moba_hf.integration.rope_remap import resolve

TINY = {**tiny_models.TINY, "max_position_embeddings": 16}  # DCA's c
DENSE = MobaConfig(sparse=False, dca=DcaConfig(chunk_size=12))  # c = 16 from the model, s = 12
SPARSE = MobaConfig(block_size=4, top_k=2, dca=DcaConfig(chunk_size=12))


def tiny_model(arch="llama", moba=None, **config):
    return tiny_models.tiny_model(arch, moba, **{"max_position_embeddings": 16, **config})


@pytest.fixture(params=sorted(ARCHS))
def arch(request):
    return request.param


def test_one_chunk_equals_plain_model(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 97, (2, 12))  # N = s
    want_sdpa = model(ids).logits
    moba_hf.apply(model, MobaConfig(sparse=False))
    want_dense = model(ids).logits
    moba_hf.apply(model, DENSE)
    assert torch.equal(model(ids).logits, want_dense)
    torch.testing.assert_close(model(ids).logits, want_sdpa, rtol=1e-12, atol=1e-12)
    moba_hf.apply(model, MobaConfig(block_size=4, top_k=2))
    want_moba = model(ids).logits
    moba_hf.apply(model, SPARSE)
    assert torch.equal(model(ids).logits, want_moba)


def test_dca_changes_long_sequences(arch):
    model = tiny_model(arch, moba=MobaConfig(sparse=False))
    ids = torch.randint(0, 97, (1, 30))
    plain = model(ids).logits
    moba_hf.apply(model, DENSE)
    dca = model(ids).logits
    torch.testing.assert_close(dca[:, :12], plain[:, :12], rtol=1e-12, atol=1e-12)
    assert (dca[:, 12:] - plain[:, 12:]).abs().max() > 1e-4


def incremental_logits(model, ids, splits):
    """Logits of a prefill of ids[:, :splits[0]], then chunks ending at the other splits, then 1-token steps."""
    cache, outs, start = None, [], 0
    points = list(splits) + list(range(splits[-1] + 1, ids.shape[1] + 1))
    for end in points:
        out = model(ids[:, start:end], cache=cache, use_cache=True)
        cache, start = out.past_key_values, end
        outs.append(out.logits)
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("moba", [DENSE, SPARSE], ids=["dense", "sparse"])
def test_cached_decoding_and_chunked_prefill_equal_full_forward(arch, moba):
    model = tiny_model(arch, moba=moba)
    ids = torch.randint(0, 97, (2, 31))
    full = model(ids).logits
    got, _ = incremental_logits(model, ids, [7, 19])  # prefill 7, chunk of 12 across s = 12, then decode to 31
    torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-10)


def test_greedy_generate_with_cache_matches_full_forward():
    model = tiny_model("llama", moba=SPARSE)
    model.generation_config.eos_token_id = None  # greedy argmax, never stopped or suppressed
    ids = torch.randint(0, 97, (1, 22))
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    logits = model(out).logits
    assert torch.equal(logits[0, 21:-1].argmax(-1), out[0, 22:])


def expected_layer0_keys(model, ids, chunk_size):
    """Layer-0 keys computed by hand: k_proj of the normed embeddings, rotated by the model at j mod s."""
    layer = model.model.layers[0]
    hidden = layer.input_layernorm(model.model.embed_tokens(ids))
    attn = layer.self_attn
    k = attn.k_proj(hidden).view(*ids.shape, -1, attn.head_dim).transpose(1, 2)
    positions = (torch.arange(ids.shape[1]) % chunk_size)[None]
    cos, sin = model.model.rotary_emb(k, positions)
    return k * cos[:, None] + rotate_half(k) * sin[:, None]


@pytest.mark.parametrize(
    "rope",
    [None, {"rope_type": "linear", "factor": 2.0}, {"rope_type": "yarn", "factor": 4.0}],
    ids=["default", "linear", "yarn"],
)
def test_cache_holds_keys_rotated_at_j_mod_s(rope):
    extra = {} if rope is None else {"rope_parameters": {"rope_theta": 10000.0, **rope}}
    model = tiny_model("llama", moba=DENSE, **extra)
    ids = torch.randint(0, 97, (1, 35))
    _, cache = incremental_logits(model, ids, [17, 26])
    # the model forms RoPE angles in float32: agreement to float32-angle accuracy (a wrong frequency is off by O(1))
    torch.testing.assert_close(cache.layers[0].keys, expected_layer0_keys(model, ids, 12), rtol=0, atol=1e-6)


@pytest.mark.parametrize("moba", [DENSE, SPARSE], ids=["dense", "sparse"])
def test_left_padded_batch_equals_single_sequences(moba):
    model = tiny_model("llama", moba=moba)
    lengths = (28, 19)
    seqs = [torch.randint(0, 97, (1, n)) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, width - seq.shape[1] :] = seq[0]
        mask[row, width - seq.shape[1] :] = 1
    generate_positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # generate's positions (exact), and the default arange: RoPE then rotates the padded row's tokens at
    # shifted float32 angles, which DCA moves back to the sequence's own positions (float32-angle accuracy)
    for position_ids, tol in ((generate_positions, 1e-10), (None, 1e-6)):
        batched = model(ids, attention_mask=mask, position_ids=position_ids).logits
        for row, seq in enumerate(seqs):
            single = model(seq).logits
            torch.testing.assert_close(batched[row, width - seq.shape[1] :], single[0], rtol=0, atol=tol)


def test_padded_generate_matches_unpadded():
    model = tiny_model("llama", moba=SPARSE)
    seqs = [torch.randint(0, 97, (1, n)) for n in (24, 17)]
    ids = torch.zeros(2, 24, dtype=torch.long)
    mask = torch.zeros(2, 24, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, 24 - seq.shape[1] :] = seq[0]
        mask[row, 24 - seq.shape[1] :] = 1
    model.generation_config.eos_token_id = None
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for row, seq in enumerate(seqs):
        single = model.generate(seq, max_new_tokens=8, do_sample=False)
        assert torch.equal(batched[row, 24:], single[0, seq.shape[1] :])


def test_plain_from_config_path_without_apply(tmp_path):
    """A checkpoint saved with a DCA moba_config works through from_pretrained(attn_implementation="moba")."""
    model = tiny_model("qwen2", moba=SPARSE)
    ids = torch.randint(0, 97, (1, 30))
    want = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="moba", dtype=torch.float64).eval()
    assert loaded.config.moba_config["dca"]["chunk_size"] == 12
    torch.testing.assert_close(loaded(ids).logits, want, rtol=1e-12, atol=1e-12)


def test_hybrid_layers_run_dense_dca_and_are_tracked():
    model = tiny_model("llama", moba=SPARSE.replace(full_attn_layers=1))
    with moba_hf.track_sparsity() as stats:
        model(torch.randint(0, 97, (1, 40)))
    assert stats.backends == {0: "dca+moba", 1: "dca"}
    assert 0 < stats.per_layer()[0] < 1 and stats.per_layer()[1] == 0


def test_full_decode_steps_run_dense_dca_over_the_sparse_prefills_cache():
    model = tiny_model("llama", moba=SPARSE.replace(decode="full"))
    ids = torch.randint(0, 97, (1, 41))
    with torch.no_grad():
        cache = model(ids[:, :40], use_cache=True).past_key_values
    with torch.no_grad(), moba_hf.track_sparsity() as stats:
        step = model(ids[:, 40:], cache=copy.deepcopy(cache), use_cache=True).logits
    assert set(stats.backends.values()) == {"dca"}
    moba_hf.apply(model, DENSE)
    with torch.no_grad():
        dense_step = model(ids[:, 40:], cache=copy.deepcopy(cache), use_cache=True).logits
    torch.testing.assert_close(step, dense_step, rtol=0, atol=0)
    moba_hf.apply(model, SPARSE)  # sparse steps choose 2 of 11 blocks: not the dense step
    with torch.no_grad():
        sparse_step = model(ids[:, 40:], cache=cache, use_cache=True).logits
    assert (sparse_step - dense_step).abs().max() > 1e-6


def test_packed_documents_remap_per_document():
    model = tiny_model("llama", moba=SPARSE)
    docs = [torch.randint(0, 97, (1, n)) for n in (26, 15)]
    packed = torch.cat(docs, dim=1)
    position_ids = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    got = model(packed, position_ids=position_ids, use_cache=False).logits  # transformers packs cache-free forwards
    torch.testing.assert_close(got[:, :26], model(docs[0]).logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(got[:, 26:], model(docs[1]).logits, rtol=0, atol=1e-10)


# --- configuration -------------------------------------------------------------------------------------


def test_defaults_and_qwen_block():
    config = LlamaConfig(**{**TINY, "max_position_embeddings": 8192})
    assert resolve(True, config) == DcaParams(8192, 7168)
    assert resolve(None, config) is None
    assert resolve(DcaConfig(local_window=2048), config) == DcaParams(8192, 6144)
    assert resolve(DcaConfig(pretraining_length=4096), config, block_size=512) == DcaParams(4096, 3584)
    assert resolve(DcaConfig(pretraining_length=1000), config, block_size=64) == DcaParams(1000, 832)
    qwen = Qwen2Config(**TINY)
    qwen.dual_chunk_attention_config = {
        "chunk_size": 262144,
        "local_size": 8192,
        "original_max_position_embeddings": 262144,
    }
    assert resolve(None, qwen) == DcaParams(262145, 253952)  # no extra setting needed
    assert resolve(False, qwen) is None
    assert resolve(DcaConfig(temperature=True), qwen).temperature
    llama3 = LlamaConfig(
        **{**TINY, "max_position_embeddings": 131072},
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    assert resolve(True, llama3).pretraining_length == 8192


def test_temperature_factor():
    p = DcaParams(8192, 7168, temperature=True)
    assert p.temperature_factor(4096) == 1.0
    assert p.temperature_factor(8192 * 4) == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    assert DcaParams(8192, 7168).temperature_factor(10**6) == 1.0


def test_config_round_trip_and_file(tmp_path):
    config = MobaConfig(block_size=512, dca=DcaConfig(pretraining_length=8192, chunk_size=7168, temperature=True))
    assert MobaConfig.from_dict(config.to_dict()) == config
    path = tmp_path / "dca.toml"
    path.write_text("sparse = false\n[dca]\npretraining_length = 8192\nchunk_size = 6000\n")
    loaded = MobaConfig.from_file(path)
    assert loaded.dca == DcaConfig(pretraining_length=8192, chunk_size=6000) and not loaded.sparse


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dca=DcaConfig(pretraining_length=8192, chunk_size=7000)), r"nearest valid chunk_size: 6656 or 7168"),
        (dict(dca=dict(pretraining_length=8, chunk_size=8)), r"0 < chunk_size < pretraining_length"),
        (dict(dca=dict(pretraining_length=8, chunk_size=0)), r"chunk_size must be an integer >= 1"),
        (dict(dca=dict(chunk_size=4, local_window=4)), r"either chunk_size or local_window"),
        (dict(dca=dict(chunk=4)), r"unknown DCA config keys \['chunk'\]"),
        (dict(dca="yes"), r"dca must be"),
        (dict(sparse="no"), r"sparse must be true or false"),
    ],
)
def test_bad_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MobaConfig(**kwargs)


def test_errors_against_the_model():
    with pytest.raises(ValueError, match="rope_scaling type is 'dynamic'"):
        tiny_model("llama", moba=DENSE, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="0 < chunk_size < pretraining_length"):
        tiny_model("llama", moba=MobaConfig(sparse=False, dca=DcaConfig(chunk_size=16)))  # c = 16 from the model
    with pytest.raises(ValueError, match="multiple of the MoBA block_size=4.*nearest valid chunk_size: 8 or 12"):
        tiny_model("llama", moba=MobaConfig(block_size=4, dca=DcaConfig(local_window=5)))


def test_cli_prints_example_row(capsys):
    from moba_hf.cli import main

    assert main(["dca-matrix", "--seq-len", "13", "--pretraining-length", "8", "--chunk-size", "6"]) == 0
    assert "12: 7 6 5 4 3 2 | 6 5 4 3 2 1 | 0" in capsys.readouterr().out


def test_shipped_presets_load():
    dense = MobaConfig.preset("dca-dense")
    sparse = MobaConfig.preset("dca-moba")
    assert not dense.sparse and dense.dca == DcaConfig()
    assert sparse.sparse and sparse.dca == DcaConfig(pretraining_length=4096, temperature=True)
    assert sparse.dense_tail > 0 and sparse.pooling == "bound" and sparse.decode == "full"
    baseline = MobaConfig.from_spec(str(Path(__file__).parent.parent / "configs" / "dca_dense_c4096.toml"))
    assert baseline == MobaConfig(sparse=False, dca=sparse.dca)  # the preset's dense baseline: the same DCA
    larger = MobaConfig.from_spec(str(Path(__file__).parent.parent / "configs" / "dca_moba_dense01_top8.toml"))
    assert larger == dataclasses.replace(sparse, top_k=8, full_attn_layer_ids=(0, 1))  # the preset, larger budget
    model_config = LlamaConfig(**{**TINY, "max_position_embeddings": 8192})
    assert resolve(dense.dca, model_config) == DcaParams(8192, 7168)
    assert resolve(sparse.dca, model_config, sparse.block_size) == DcaParams(4096, 3584, temperature=True)


def test_bfloat16_padded_batch_runs_close_to_float64():
    model = tiny_model("llama", moba=DENSE)
    ids = torch.randint(0, 97, (2, 30))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding, default arange positions: the remap rotates every fresh token
    want = model(ids, attention_mask=mask).logits
    got = model.to(torch.bfloat16)(ids, attention_mask=mask).logits
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got[mask.bool()].double(), want[mask.bool()], rtol=0, atol=0.05)


def test_training_backward_matches_float64_finite_difference():
    """No cache (training): the in-place key remap must keep autograd exact. (RMSNorm runs in float32, so the
    finite difference needs a large step; its O(step^2) error is far below the tolerance.)"""
    model = tiny_model("llama", moba=DENSE)
    ids = torch.randint(0, 97, (1, 30))
    weight = model.model.layers[0].self_attn.k_proj.weight

    def loss_fn():
        logits = model(ids, use_cache=False).logits[0, :-1]
        return torch.nn.functional.cross_entropy(logits, ids[0, 1:])

    (grad,) = torch.autograd.grad(loss_fn(), weight)
    direction = torch.randn_like(weight)
    eps = 1e-3
    with torch.no_grad():
        weight += eps * direction
        plus = loss_fn()
        weight -= 2 * eps * direction
        minus = loss_fn()
        weight += eps * direction
    torch.testing.assert_close((grad * direction).sum(), (plus - minus) / (2 * eps), rtol=1e-3, atol=1e-8)


def oracle_logits(model, ids, pretraining_length, chunk_size):
    """Logits of `model` whose attention undoes the RoPE it was given (true positions) and applies the paper's DCA
    rules pair by pair (tests/test_dca_kernels.py). Leaves the model on that oracle attention."""
    from test_dca_kernels import reference_dca
    from transformers import AttentionInterface

    inv_freq = model.model.rotary_emb.inv_freq.double()  # the frequencies the model rotated q and k with

    def unrotate(x: torch.Tensor) -> torch.Tensor:
        angles = torch.arange(x.shape[2], dtype=torch.float64)[:, None] * inv_freq[None, :]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        return x * cos - rotate_half(x) * sin  # RoPE by minus the position

    def oracle(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out = reference_dca(unrotate(query), unrotate(key), value, pretraining_length, chunk_size, inv_freq, scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("dca_oracle_test", oracle)
    model.set_attn_implementation("dca_oracle_test")
    return model(ids).logits


def test_model_equals_an_independent_dca_oracle(arch):
    """End to end: the model with dense DCA gives the oracle's logits."""
    c, s = TINY["max_position_embeddings"], 12
    model = tiny_model(arch)
    ids = torch.randint(0, 97, (2, 31))  # three chunks: intra, successive and inter parts all occur
    want = oracle_logits(model, ids, c, s)
    moba_hf.apply(model, MobaConfig(sparse=False, dca=DcaConfig(chunk_size=s)))
    torch.testing.assert_close(model(ids).logits, want, rtol=1e-10, atol=1e-10)
