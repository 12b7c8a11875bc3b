import importlib.util

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_triton = pytest.mark.skip(reason="needs triton")
    has_triton = importlib.util.find_spec("triton") is not None
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if "triton" in item.keywords and not has_triton:
            item.add_marker(skip_triton)


@pytest.fixture(autouse=True)
def _sparse_decode_always(monkeypatch):
    # decode="moba" takes its sparse step from the first block on (machine-independent); the measured crossover
    # has its own tests
    monkeypatch.setenv("MOBA_HF_DECODE_CROSSOVER", "0")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny models: one thread avoids oversubscription spin on a shared machine (measured 16x faster)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded SmolLM2 tokenizer, read from the GGUF's metadata (no dequantizing; a missing install fails)."""
    from transformers import AutoTokenizer

    from moba_hf.models import gguf_path

    gguf = gguf_path("smollm2")
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="module")
def tiny_llama(tokenizer):
    """A tiny random float32 Llama over the embedded tokenizer's vocabulary, for the evaluation tests."""
    torch.manual_seed(0)
    return tiny_model("llama", dtype=torch.float32, vocab_size=len(tokenizer), max_position_embeddings=1024)


@pytest.fixture(scope="session")
def tiny_dir(tokenizer, tmp_path_factory):
    """A saved tiny random Llama with the embedded tokenizer: a local checkpoint for the CLI and lm-eval."""
    torch.manual_seed(0)
    model = tiny_model(
        "llama", dtype=torch.float32, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
