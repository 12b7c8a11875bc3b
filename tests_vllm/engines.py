"""Helpers of the vLLM plugin tests (run in the vLLM virtualenv: make test-vllm).

Engine runs are expensive (~1 minute to start on 2 cores), so every engine configuration runs once per
session, in a subprocess (engine_job.py), over all the prompts the tests need; tests read its JSON.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from server_helpers import model_path

HERE = Path(__file__).resolve().parent
ENGINE_TIMEOUT_S = 600
MAX_MODEL_LEN = 4096
# environment of every engine: a bounded KV cache, no usage reporting, the engine core in its own process
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def engine_kwargs(**extra) -> dict:
    return dict(model=model_path(), dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True, seed=0, **extra)


def run_engine(job: dict, env: dict[str, str | None] | None = None, timeout: float = ENGINE_TIMEOUT_S) -> dict:
    """Start one engine in a subprocess, run the job's phases, return its results and, under "_log", its
    output (fails with the log). `env` is added to ENGINE_ENV; a None value unsets the variable."""
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps(job))
        returncode, out, err = _run_job(job_file, out_file, env, timeout)
        if returncode != 0 or not out_file.is_file():
            pytest.fail(f"engine run failed (rc={returncode}):\n{err[-6000:]}")
        return {**json.loads(out_file.read_text()), "_log": out + err}


def _run_job(job_file: Path, out_file: Path, env: dict[str, str | None] | None, timeout: float) -> tuple[int, str, str]:
    """engine_job.py in its own process group, so a timeout stops the engine's processes too (none is left
    running on the machine)."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "engine_job.py"), str(job_file), str(out_file)],
        env={k: v for k, v in {**os.environ, **ENGINE_ENV, **(env or {})}.items() if v is not None},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"engine run timed out after {timeout} s:\n{err[-6000:]}")
    return proc.returncode, out, err


def start_engine_expecting_refusal(engine: dict, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    """Start an engine that must refuse to start; return its output (vLLM logs the workers' errors to stdout)."""
    job = {"engine": engine, "phases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        job_file = Path(tmp) / "job.json"
        job_file.write_text(json.dumps(job))
        returncode, out, err = _run_job(job_file, Path(tmp) / "out.json", env, timeout)
        assert returncode != 0, "the engine started although it should have refused"
        return out + err


def hf_generate(moba: dict | None, prompts: list[list[int]], max_tokens: int, path: str | None = None) -> list[dict]:
    """The transformers path (attn_implementation="moba", or "sdpa" for moba=None), greedy, float32; the
    embedded SmolLM2 unless `path`."""
    import torch

    import moba_hf

    kwargs = {"moba": moba} if moba is not None else {"attn_implementation": "sdpa"}
    model = moba_hf.from_pretrained(path or model_path(), dtype=torch.float32, **kwargs).eval()
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            first = torch.log_softmax(out.logits[0][0].float(), dim=-1)
            results.append({"tokens": out.sequences[0, len(ids) :].tolist(), "first_logprobs": first})
    return results


def logprob_gap(vllm_result: dict, hf_logprobs) -> float:
    """Largest |difference| between vLLM's first-step top-5 logprobs and the HF logprobs of the same tokens."""
    step = vllm_result["logprobs"][0]
    gaps = [abs(lp - float(hf_logprobs[int(t)])) for t, lp in step.items()]
    return max(g for g in gaps if g == g)  # NaN: a token the reference does not list
