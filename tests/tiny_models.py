"""The tiny random decoders the model-level tests build (imported by the tests and by conftest's fixtures)."""

import torch

# the tiny random decoders the model-level tests run (float64, so tolerances stay at rounding level)
TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
ARCHS = ("llama", "qwen2", "qwen3")
# the training tests' sizes: a vocabulary of 128 for their token-id documents
TRAIN = dict(vocab_size=128, hidden_size=64, intermediate_size=128, max_position_embeddings=2048)


def tiny_model(arch: str = "llama", moba=None, layers: int = 2, *, dtype=torch.float64, **config):
    """A tiny random `arch` model (TINY, `layers` layers, `config` overrides) in `dtype` and eval mode, with sdpa
    attention, or switched to MoBA with `moba` (a MobaConfig) when given."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import moba_hf

    model_config = AutoConfig.for_model(arch, **{**TINY, "num_hidden_layers": layers, **config})
    if arch == "qwen3" and "head_dim" not in config:
        model_config.head_dim = 8  # its default is 128
    model = AutoModelForCausalLM.from_config(model_config, attn_implementation="sdpa", dtype=dtype).eval()
    return model if moba is None else moba_hf.apply(model, moba)


def train_model(seed: int = 0, dtype=torch.float32):
    """The tiny Llama the training tests train: `tiny_model` with TRAIN sizes, seeded, in training mode."""
    torch.manual_seed(seed)
    return tiny_model("llama", dtype=dtype, **TRAIN).train()
