"""What the server plugin tests share (tests_vllm in vLLM's virtualenv, tests_sglang in SGLang's; pyproject's
pytest `pythonpath` puts this folder on sys.path): the embedded model and its tokenizer, prompts of an exact token
count, and a server process's port, health, log and stop."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path


@functools.lru_cache(maxsize=1)
def model_path() -> str:
    from moba_hf.models import local_path

    return str(local_path())


@functools.lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path())


def prompt_ids(n_tokens: int, seed: int) -> list[int]:
    """A prose-like prompt of exactly n_tokens tokens (deterministic; varied text, so no gate ties)."""
    from moba_hf.eval.texts import generated_text

    tok = tokenizer()
    question = " In one sentence, who appears most often in this story?"
    tail = tok(question, add_special_tokens=False).input_ids
    body = tok(generated_text(n_tokens, seed=seed), add_special_tokens=False).input_ids
    return body[: n_tokens - len(tail)] + tail


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(base: str) -> bool:
    """The server at `base` answers its /health with 200."""
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def stop(server: subprocess.Popen) -> None:
    """End the server's process group (started with start_new_session: bash or the launcher, and the engine
    processes it started)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)  # what outlived the process that started them


# Qwen's convention: c = chunk_size + 1, s = chunk_size - local_size (the transformers path's mapping)
QWEN_DCA = {"chunk_size": 1023, "local_size": 127, "original_max_position_embeddings": 1024}


def qwen_dca_checkpoint(path: Path, layers: int) -> str:
    """SmolLM2's first `layers` layers saved in `path` as a Qwen2 checkpoint (zero q / k / v biases) whose config
    carries QWEN_DCA as its dual_chunk_attention_config: what both server plugins serve with dense DCA."""
    import json
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    source = model_path()
    llama = AutoConfig.from_pretrained(source)
    config = Qwen2Config(
        vocab_size=llama.vocab_size,
        hidden_size=llama.hidden_size,
        intermediate_size=llama.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=llama.num_attention_heads,
        num_key_value_heads=llama.num_key_value_heads,
        max_position_embeddings=llama.max_position_embeddings,
        rope_parameters=dict(llama.rope_parameters),
        rms_norm_eps=llama.rms_norm_eps,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=llama.bos_token_id,
        eos_token_id=llama.eos_token_id,
        dual_chunk_attention_config=QWEN_DCA,
    )
    weights = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    model = Qwen2ForCausalLM(config).to(torch.float32)
    missing, _ = model.load_state_dict(weights, strict=False)
    assert all(name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) for name in missing), missing
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.zero_()
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{source}/{name}", path / name)
    assert json.loads((path / "config.json").read_text())["dual_chunk_attention_config"] == QWEN_DCA
    return str(path)
