"""The README's SGLang serving command, exactly as printed, starts a server that answers the `openai` client: a
completion and a streamed chat (slow: one server).

The command is the ```bash block right after the line `<!-- serve command: tests_sglang/test_readme_serve.py -->`
in README.md. Two placeholders are
substituted, nothing else: `PATH` (the embedded SmolLM2) and the port of `--port 30000` (a free loopback port). It
runs under bash with this virtualenv's bin directory first on PATH (an activated virtualenv), so its `python` is
this one; the stand-ins go on PYTHONPATH (stand_ins/README).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest
from server_helpers import free_port, model_path
from servers import HERE, server, server_env

pytestmark = pytest.mark.slow

README = HERE.parent / "README.md"
MARKER = "<!-- serve command: tests_sglang/test_readme_serve.py -->"
PORT = "--port 30000"


def readme_text() -> str:
    return README.read_text()


def serve_command(readme: str) -> str:
    """The marked block's text (continuation lines kept as printed)."""
    lines = readme.splitlines()
    if lines.count(MARKER) != 1:
        raise ValueError(f"the README must have exactly one line {MARKER!r}, found {lines.count(MARKER)}")
    i = lines.index(MARKER)
    if lines[i + 1].strip() != "```bash":
        raise ValueError(f"the line after {MARKER!r} must open a ```bash block")
    end = lines.index("```", i + 2)
    command = "\n".join(lines[i + 2 : end])
    for placeholder in ("PATH", PORT):
        if len(re.findall(rf"(?<![\w-]){re.escape(placeholder)}(?!\w)", command)) != 1:
            raise ValueError(f"the serve command must hold {placeholder!r} once:\n{command}")
    return command


def substituted(command: str, model: str, port: int) -> str:
    command = re.sub(r"(?<![\w-])PATH(?!\w)", lambda _: shlex.quote(model), command)
    return command.replace(PORT, f"--port {port}")


def test_serve_command_is_found_and_substituted():
    command = serve_command(readme_text())
    assert "--attention-backend moba" in command
    done = substituted(command, "/models/my model", 12345)
    assert "'/models/my model'" in done and "--port 12345" in done and "PATH" not in done and "30000" not in done


def test_readme_serve_command_answers_the_openai_client(tmp_path: Path):
    import openai

    port = free_port()
    command = substituted(serve_command(readme_text()), model_path(), port)
    env = server_env()
    for name in ("SGLANG_USE_CPU_ENGINE", "MOBA_HF_CONFIG"):
        env.pop(name, None)  # only what the README sets
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = tmp_path / "serve.log"
    with server(command, env, log, port, cwd=tmp_path) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        completion = client.completions.create(
            model=model_path(), prompt="The capital of France is", max_tokens=4, temperature=0.0
        )
        stream = client.chat.completions.create(
            model=model_path(),
            messages=[{"role": "user", "content": "Name one colour."}],
            max_tokens=8,
            temperature=0.0,
            stream=True,
        )
        pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert completion.choices[0].text.strip() and completion.usage.completion_tokens == 4, completion
    assert len(pieces) > 1 and "".join(pieces).strip(), pieces
    assert "moba_hf: SGLang attention runs" in log.read_text()  # the plugin, with the README's config
