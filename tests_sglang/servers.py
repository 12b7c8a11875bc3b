"""Helpers of the SGLang plugin tests (run in the SGLang virtualenv: make test-sglang).

A server start costs about 1.5 minutes on 2 cores (mostly imports), so each server configuration starts once per
module, in its own process group (stopped whole), and tests send it all the prompts they need.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import healthy, model_path, stop, tail

HERE = Path(__file__).resolve().parent
STAND_INS = HERE / "stand_ins"
START_S = 600  # about 90 s on an idle 2-core machine; a busy one takes several times that
# every server: the CPU engine (without it the worker imports vLLM's rotary embedding), a bounded KV pool
SERVER_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
SERVER_ARGS = ["--device", "cpu", "--dtype", "float32", "--disable-cuda-graph", "--random-seed", "0",
               "--log-level", "warning"]  # fmt: skip


def server_env(extra: dict[str, str | None] | None = None, log_names: Path | None = None) -> dict[str, str]:
    """This environment plus SERVER_ENV and `extra` (None unsets), the stand-ins first on PYTHONPATH."""
    env = {**os.environ, **SERVER_ENV, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STAND_INS), env.get("PYTHONPATH")) if p)
    if log_names is not None:
        env["MOBA_HF_STAND_IN_LOG"] = str(log_names)
    return {k: v for k, v in env.items() if v is not None}


def launch_command(*args: str, port: int, max_total_tokens: int = 20000, path: str | None = None) -> list[str]:
    """`python -m sglang.launch_server` on `path` (default the embedded SmolLM2) with SERVER_ARGS, a KV pool of
    `max_total_tokens` and `args`."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", path or model_path(), "--host",
            "127.0.0.1", "--port", str(port), *SERVER_ARGS, "--max-total-tokens", str(max_total_tokens),
            *args]  # fmt: skip


@contextlib.contextmanager
def server(
    command: list[str] | str, env: dict[str, str], log: Path, port: int, cwd: Path | None = None
) -> Iterator[str]:
    """Start a server (a list: the command; a string: a bash command line), wait until healthy, yield its base
    URL, stop it. Fails with the log's tail when it exits or is not healthy in START_S."""
    argv = ["bash", "-c", command] if isinstance(command, str) else command
    base = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + START_S
            while not healthy(base):
                if proc.poll() is not None:
                    pytest.fail(f"the server exited with {proc.returncode}:\n{tail(log)}")
                if time.monotonic() > deadline:
                    pytest.fail(f"the server was not healthy after {START_S} s:\n{tail(log)}")
                time.sleep(3)
            yield base
        finally:
            stop(proc)


def start_expecting_refusal(command: list[str], env: dict[str, str], log: Path, timeout: float = START_S) -> str:
    """Start a server that must refuse to start; return its output."""
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server neither started nor refused in {timeout} s:\n{tail(log)}")
        finally:
            stop(proc)
    output = log.read_text(errors="replace")
    assert "Uvicorn running" not in output, "the server started although it should have refused"
    return output


def generate(base: str, ids: list[int], max_tokens: int, ignore_eos: bool = False) -> dict:
    """SGLang's native /generate, greedy: {"tokens": [...], "cached": prompt tokens served from the radix cache}."""
    sampling = {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": ignore_eos}
    body = {"input_ids": ids, "sampling_params": sampling}
    request = urllib.request.Request(
        f"{base}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    return {"tokens": answer["output_ids"], "cached": answer["meta_info"]["cached_tokens"]}


def flush_cache(base: str) -> None:
    with urllib.request.urlopen(urllib.request.Request(f"{base}/flush_cache", b"", method="POST"), timeout=60):
        pass


def hf_generate(
    moba: dict | None,
    prompts: list[list[int]],
    max_tokens: int,
    path: str | None = None,
    ignore_eos: bool = False,
    dtype: str = "float32",
) -> list[list[int]]:
    """The transformers path (attn_implementation="moba", or "sdpa" for moba=None) on `path` (default the
    embedded SmolLM2), greedy, in `dtype` (the server's --dtype); ignore_eos: max_tokens tokens whatever they are
    (as SGLang's)."""
    import torch

    import moba_hf

    kwargs = {"moba": moba} if moba is not None else {"attn_implementation": "sdpa"}
    model = moba_hf.from_pretrained(path or model_path(), dtype=getattr(torch, dtype), **kwargs).eval()
    if ignore_eos:
        model.generation_config.eos_token_id = None
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
            )
            results.append(out[0, len(ids) :].tolist())
    return results
