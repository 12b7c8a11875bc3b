"""More decoder families through attn_implementation="moba" / moba_hf.apply, and DCA where their RoPE allows it.

Each family: a tiny random float64 checkpoint (2 layers, hidden 64) that differs from Llama in what matters to
attention (MoE MLPs, head_dim != hidden / heads, biases, qk-norm, scaling, interleaved or partial RoPE).
Checks: top_k >= blocks equals sdpa in every layer and sparse MoBA the reference kernel, cached greedy
generate equals the full forward's greedy, a left-padded batch equals each row alone, save / reload keeps
moba_config, training gradients equal sdpa's, DCA equals the independent oracle of test_dca_models (or is
refused, naming why). Llama, Qwen2 and Qwen3 run in test_integration.py and test_dca_models.py.
"""

import logging

import pytest
import torch
from kernel_cases import call
from test_dca_models import oracle_logits
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

import moba_hf
from moba_hf import DcaConfig, MobaConfig
from moba_hf.integration.support import check_dca_rope, check_supported
from moba_hf.kernels import moba_attention_reference

VOCAB = 97
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16,  # DCA's c; RoPE itself does not stop there
    tie_word_embeddings=False,
)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# family id -> (model_type, config overrides, why DCA is refused or None)
FAMILIES = {
    "mistral": ("mistral", dict(sliding_window=None), None),
    "mistral-rope-llama3": ("mistral", dict(sliding_window=None, rope_parameters=LLAMA3), None),
    "mixtral-moe": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None), None),
    "qwen2_moe-bias-shared-expert": ("qwen2_moe", dict(MOE, shared_expert_intermediate_size=32), None),
    "qwen3_moe-qknorm-hd32": ("qwen3_moe", dict(MOE, head_dim=32), None),
    "phi3-fused-qkv": ("phi3", dict(pad_token_id=0, original_max_position_embeddings=16), None),  # DCA's c
    "gemma-hd32": ("gemma", dict(head_dim=32), None),
    "granite-attn-multiplier": ("granite", dict(attention_multiplier=0.3, embedding_multiplier=2.0), None),
    "olmo-clip-qkv": ("olmo", dict(clip_qkv=0.5, pad_token_id=0), None),
    "olmo2-qknorm": ("olmo2", dict(pad_token_id=0), None),
    "cohere-interleaved-rope": ("cohere", dict(use_qk_norm=True), "pairs dimensions differently"),
    "stablelm-partial-rope": ("stablelm", dict(qk_layernorm=True, use_qkv_bias=True), r"RoPE covers 4 of 16"),
}
SPARSE = MobaConfig(block_size=4, top_k=2)
FULL = MobaConfig(block_size=8, top_k=8)  # >= the blocks of every sequence here
DCA_S = 12
LOAD = dict(dtype=torch.float64, experts_implementation="eager")  # the grouped-mm MoE path has no float64


def tiny(family):
    model_type, extra, _ = FAMILIES[family]
    config = AutoConfig.for_model(model_type, **{**TINY, **extra})
    if "head_dim" in extra:
        config.head_dim = extra["head_dim"]  # some configs take it only as an attribute
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", **LOAD).eval()


@pytest.fixture(params=sorted(FAMILIES))
def family(request, one_thread):
    return request.param


def test_the_verified_list_is_what_the_tests_run():
    tested = {FAMILIES[f][0] for f in FAMILIES} | {"llama", "qwen2", "qwen3"}
    assert tested == set(moba_hf.SUPPORTED_MODEL_TYPES)


def reference_moba(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The readable kernel on exactly the q, k, v and scale the family hands over (no padding here)."""
    gate = dict(block_size=SPARSE.block_size, top_k=SPARSE.top_k)
    return call(moba_attention_reference, query, key, value, scale=scaling, **gate).transpose(1, 2), None


def test_full_coverage_equals_sdpa_and_sparse_equals_the_reference(family):
    model = tiny(family)
    ids = torch.randint(0, VOCAB, (2, 45))
    want = model(ids).logits
    moba_hf.apply(model, FULL)
    with moba_hf.track_sparsity() as stats:
        got = model(ids).logits
    assert set(stats.backends) == {0, 1}  # transformers called moba in every layer
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    AttentionInterface.register("moba_reference_test", reference_moba)
    model.set_attn_implementation("moba_reference_test")
    sparse_want = model(ids).logits
    moba_hf.apply(model, SPARSE)
    sparse = model(ids).logits
    torch.testing.assert_close(sparse, sparse_want, rtol=1e-9, atol=1e-9)
    assert (sparse - want).abs().max() > 1e-4  # sparsity reaches the logits


def test_cached_greedy_equals_full_forward_greedy(family):
    model = moba_hf.apply(tiny(family), SPARSE)
    model.generation_config.eos_token_id = None  # plain argmax, never stopped
    ids = torch.randint(0, VOCAB, (1, 22))
    # an explicit mask: generate would otherwise read token pad_token_id in the prompt as padding
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
    assert torch.equal(model(out).logits[0, 21:-1].argmax(-1), out[0, 22:])


def test_left_padded_batch_equals_each_row(family):
    model = moba_hf.apply(tiny(family), SPARSE)
    seqs = [torch.randint(1, VOCAB, (1, n)) for n in (29, 18)]
    ids = torch.zeros(2, 29, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, 29 - seq.shape[1] :], mask[row, 29 - seq.shape[1] :] = seq[0], 1
    batched = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(batched[row, 29 - seq.shape[1] :], model(seq).logits[0], rtol=0, atol=1e-10)


def test_save_and_reload_keep_moba_config(family, tmp_path):
    model = moba_hf.apply(tiny(family), SPARSE)
    ids = torch.randint(0, VOCAB, (1, 30))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="moba", **LOAD).eval()
    assert MobaConfig.from_dict(loaded.config.moba_config) == SPARSE
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-12)


def test_training_gradients_equal_sdpa(family):
    model = tiny(family).train()
    ids = torch.randint(0, VOCAB, (2, 37))

    def grads():
        model.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    want = grads()
    moba_hf.apply(model, FULL)
    got = grads()
    assert got.keys() == want.keys() and any("self_attn" in name for name in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-8, atol=1e-10, msg=name)


def test_dca_equals_the_oracle_or_is_refused(family):
    refused = FAMILIES[family][2]
    model = tiny(family)
    dca = MobaConfig(sparse=False, dca=DcaConfig(chunk_size=DCA_S))
    if refused is not None:
        with pytest.raises(ValueError, match=f"DCA.*{refused}"):
            moba_hf.apply(model, dca)
        return
    ids = torch.randint(0, VOCAB, (2, 31))  # three chunks of 12: intra, successive and inter parts
    want = oracle_logits(model, ids, TINY["max_position_embeddings"], DCA_S)
    moba_hf.apply(model, dca)
    torch.testing.assert_close(model(ids).logits, want, rtol=1e-10, atol=1e-10)


# --- refusals: config-only checks, no model built -------------------------------------------------------------

REFUSED = {
    "mistral-sliding-window": (lambda: AutoConfig.for_model("mistral", sliding_window=8), r"sliding_window=8"),
    "gemma2-softcap-mixed-layers": (
        lambda: AutoConfig.for_model("gemma2"),
        r"softcap=.*layer_types \['full_attention', 'sliding_attention'\]",
    ),
    "gpt2-no-rope": (lambda: AutoConfig.for_model("gpt2"), r"no RoPE"),
    "mllama-composite": (lambda: AutoConfig.for_model("mllama"), r"composite model"),
    "mllama-text-cross-attention": (
        lambda: AutoConfig.for_model("mllama").text_config,
        r"MllamaTextCrossAttention is not always causal",
    ),
    "gemma-bidirectional": (
        lambda: AutoConfig.for_model("gemma", use_bidirectional_attention=True),
        r"use_bidirectional_attention=True",
    ),
    "gpt_oss-sinks": (lambda: AutoConfig.for_model("gpt_oss"), r"s_aux="),
    "deepseek_v3-latent-attention": (lambda: AutoConfig.for_model("deepseek_v3"), r"values have head dim 128"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_models_are_refused_saying_what_is_missing(case):
    build, match = REFUSED[case]
    config = build()
    with pytest.raises(ValueError, match=rf"model_type='{config.model_type}'.*{match}"):
        check_supported(config)


@pytest.mark.parametrize(
    "model_type,rope",
    [
        ("mistral", {"rope_type": "dynamic", "factor": 2.0}),
        ("phi3", {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                  "original_max_position_embeddings": 8}),
    ],
    ids=["mistral-dynamic", "phi3-longrope"],
)  # fmt: skip
def test_dca_refuses_sequence_dependent_rope(model_type, rope):
    config = AutoConfig.for_model(model_type, **TINY, rope_parameters={"rope_theta": 1e4, **rope}, sliding_window=None)
    check_supported(config)  # MoBA alone is fine
    with pytest.raises(ValueError, match=f"rope_scaling type is '{rope['rope_type']}'"):
        check_dca_rope(config)


def test_unverified_family_that_passes_the_checks_runs_with_a_note(caplog):
    with caplog.at_level(logging.WARNING, logger="moba_hf"):
        check_supported(AutoConfig.for_model("starcoder2", sliding_window=None))
    assert "model_type='starcoder2' passes the support checks but no test runs it" in caplog.text


def test_attention_dropout_is_refused_in_training_only(one_thread):
    config = AutoConfig.for_model("mistral", **{**TINY, "sliding_window": None, "attention_dropout": 0.1})
    model = moba_hf.apply(AutoModelForCausalLM.from_config(config, dtype=torch.float64), FULL)
    ids = torch.randint(0, VOCAB, (1, 10))
    model.eval()(ids)
    with pytest.raises(ValueError, match="dropout=0.1"):
        model.train()(ids)


def test_a_window_covering_the_context_is_full_attention_and_a_longer_prompt_is_refused(one_thread):
    # Phi-3-128K style: a sliding window longer than max_position_embeddings never cuts a key inside the context
    config = AutoConfig.for_model("mistral", **{**TINY, "sliding_window": 24, "max_position_embeddings": 24})
    check_supported(config)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", **LOAD).eval()
    ids = torch.randint(0, VOCAB, (1, 24))
    with torch.no_grad():
        want = model(ids).logits
        moba_hf.apply(model, FULL.replace(block_size=4, top_k=6))
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-10, atol=1e-10)
        with pytest.raises(ValueError, match=r"sliding_window=24 \(shorter than the 25 keys\)"):
            model(torch.randint(0, VOCAB, (1, 25)))
    with pytest.raises(ValueError, match="sliding_window=8"):
        check_supported(AutoConfig.for_model("mistral", **{**TINY, "sliding_window": 8, "max_position_embeddings": 24}))
