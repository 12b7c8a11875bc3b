import importlib.util

import pytest
import torch
from tiny_models import tiny_model


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
def _say_everything_again():
    """moba_hf logs some lines once per process (`logs.once`): each test sees its own."""
    from moba_hf import logs

    logs.forget()


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
