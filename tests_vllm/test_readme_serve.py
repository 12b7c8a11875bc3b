"""The README's serving command, exactly as printed, starts a server that answers a completion (slow: one server).

The command is the ```bash block right after the line `<!-- serve command: tests_vllm/test_readme_serve.py -->`
in README.md. Two placeholders are substituted, nothing else: `PATH` (the checkpoint: the embedded SmolLM2)
and the port of `--port 8000` (a free loopback port). It runs under bash, as a user types it, with this
virtualenv's bin directory first on PATH (an activated virtualenv), so its `python` is this one and its
environment assignments (`VLLM_CPU_KVCACHE_SPACE=...`) are the README's, not the engine tests'.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from engines import HERE
from server_helpers import free_port, healthy, model_path, stop, tail

pytestmark = pytest.mark.slow

README = HERE.parent / "README.md"
MARKER = "<!-- serve command: tests_vllm/test_readme_serve.py -->"
PORT = "--port 8000"
START_S = 600  # about a minute on an idle 2-core machine; a busy one takes several


def serve_command(readme: str) -> str:
    """The marked block's text (continuation lines kept as printed)."""
    lines = readme.splitlines()
    if lines.count(MARKER) != 1:
        raise ValueError(f"README.md must have exactly one line {MARKER!r}, found {lines.count(MARKER)}")
    i = lines.index(MARKER)
    if lines[i + 1].strip() != "```bash":
        raise ValueError(f"README.md:{i + 2}: the line after {MARKER!r} must open a ```bash block")
    end = lines.index("```", i + 2)
    command = "\n".join(lines[i + 2 : end])
    for placeholder in ("PATH", PORT):
        if len(re.findall(rf"(?<![\w-]){re.escape(placeholder)}(?!\w)", command)) != 1:
            raise ValueError(f"README.md:{i + 3}: the serve command must hold {placeholder!r} once:\n{command}")
    return command


def substituted(command: str, model: str, port: int) -> str:
    command = re.sub(r"(?<![\w-])PATH(?!\w)", lambda _: shlex.quote(model), command)
    return command.replace(PORT, f"--port {port}")


def test_serve_command_is_found_and_substituted():
    command = serve_command(README.read_text())
    assert "VLLM_CPU_KVCACHE_SPACE=" in command  # vLLM's CPU default reserves 92% of memory
    done = substituted(command, "/models/my model", 12345)
    assert "'/models/my model'" in done and "--port 12345" in done and "PATH" not in done and "8000" not in done
    with pytest.raises(ValueError, match="exactly one line"):
        serve_command("no block here")


def test_readme_serve_command_answers_a_completion(tmp_path: Path):
    port = free_port()
    command = substituted(serve_command(README.read_text()), model_path(), port)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for name in [n for n in env if n.startswith("VLLM_CPU_")]:
        del env[name]  # only what the README sets
    log_path = tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            ["bash", "-c", command], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + START_S
            while not healthy(base):
                if server.poll() is not None:
                    pytest.fail(f"the README's serve command exited with {server.returncode}:\n{tail(log_path)}")
                if time.monotonic() > deadline:
                    pytest.fail(f"the README's serve command not healthy after {START_S} s:\n{tail(log_path)}")
                time.sleep(3)
            body = {"model": model_path(), "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.0}
            request = urllib.request.Request(
                f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=300) as response:
                answer = json.loads(response.read())
        finally:
            stop(server)
    assert answer["choices"][0]["text"].strip(), answer
    assert answer["usage"]["completion_tokens"] == 4
    assert "moba_hf: vLLM attention runs" in log_path.read_text()  # the plugin, with the README's config
