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
    """The embedded SmolLM2 tokenizer (make test installs the model; a missing install fails, not skips)."""
    from transformers import AutoTokenizer

    from moba_hf.models import local_path

    return AutoTokenizer.from_pretrained(local_path("smollm2"))


@pytest.fixture(scope="session")
def tiny_dir(tokenizer, tmp_path_factory):
    """A saved tiny random Llama with the embedded tokenizer: a local checkpoint for the CLI and lm-eval."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
