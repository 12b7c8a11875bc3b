"""Run one vLLM engine over several phases of prompts and write the results as JSON (a subprocess: vLLM's
LLM starts processes, so it needs the __main__ guard).

    python engine_job.py JOB.json OUT.json
JOB: {"engine": {LLM kwargs}, "phases": {name: {"prompts": [[token ids]...], "max_tokens": n,
      "separately": bool, "prompt_logprobs": bool}}}; OUT: {name: [{"tokens": [...], "logprobs": [{token:
      logprob} per step], "prompt_logprobs": [None, then each prompt token's logprob]}...]}
or JOB: {"engines": {label: JOB}}: the engines one after another in this process (vLLM imported once),
      OUT: {label: OUT}
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    job = json.load(open(sys.argv[1]))
    out = {label: run(sub) for label, sub in job["engines"].items()} if "engines" in job else run(job)
    json.dump(out, open(sys.argv[2], "w"))


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.time()
    llm = LLM(**job["engine"])
    out: dict = {"_load_s": time.time() - start}
    for name, phase in job["phases"].items():
        prompt_logprobs = 0 if phase.get("prompt_logprobs") else None  # 0: the prompt token's own only
        params = SamplingParams(
            max_tokens=phase["max_tokens"], temperature=0.0, logprobs=5, prompt_logprobs=prompt_logprobs
        )
        prompts = [TokensPrompt(prompt_token_ids=p) for p in phase["prompts"]]
        groups = [[p] for p in prompts] if phase.get("separately") else [prompts]
        results = []
        for group in groups:
            for request in llm.generate(group, params, use_tqdm=False):
                completion = request.outputs[0]
                results.append(
                    {
                        "tokens": list(completion.token_ids),
                        "text": completion.text,
                        "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in completion.logprobs],
                    }
                )
                if prompt_logprobs is not None:
                    steps = zip(request.prompt_logprobs, request.prompt_token_ids, strict=True)
                    results[-1]["prompt_logprobs"] = [None if s is None else s[t].logprob for s, t in steps]
        out[name] = results
    out["_total_s"] = time.time() - start
    llm.llm_engine.engine_core.shutdown()  # its processes end before another engine starts
    return out


if __name__ == "__main__":
    main()
