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
