"""A tiny random Llama checkpoint whose heads split over two tensor-parallel ranks (8 query / 2 KV heads).

The embedded SmolLM2 (9 query / 3 KV heads) cannot be split in two. This one keeps SmolLM2's tokenizer (so
vLLM detokenizes) and its vocabulary size; everything else is small, and the weights are random but fixed
by the seed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 32  # head_dim 32: a size vLLM's CPU attention kernel serves
LAYERS = 2
HIDDEN = HEADS * HEAD_DIM
# larger than Llama's 0.02, under which a random model's attention scores are all close to 0 (nearly uniform
# attention): with 0.08 which keys a query attends to matters
INIT_STD = 0.08
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_tiny_llama(path: Path, tokenizer_source: str, max_positions: int, seed: int = 0) -> str:
    """Save the checkpoint (float32 safetensors + the tokenizer of `tokenizer_source`) under `path`."""
    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    source = AutoConfig.from_pretrained(tokenizer_source)
    config = LlamaConfig(
        vocab_size=source.vocab_size, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=max_positions, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=INIT_STD, tie_word_embeddings=True, bos_token_id=source.bos_token_id,
        eos_token_id=source.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_source) / name, path / name)
    return str(path)
