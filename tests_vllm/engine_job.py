"""Run one vLLM engine over several phases of prompts and write the results as JSON (a subprocess: vLLM's
LLM starts processes, so it needs the __main__ guard).

    python engine_job.py JOB.json OUT.json
JOB: {"engine": {LLM kwargs}, "phases": {name: {"prompts": [[token ids]...], "max_tokens": n,
      "separately": bool}}}; OUT: {name: [{"tokens": [...], "logprobs": [{token: logprob} per step]}...]}
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    job = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.time()
    llm = LLM(**job["engine"])
    out: dict = {"_load_s": time.time() - start}
    for name, phase in job["phases"].items():
        params = SamplingParams(max_tokens=phase["max_tokens"], temperature=0.0, logprobs=5)
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
        out[name] = results
    out["_total_s"] = time.time() - start
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
