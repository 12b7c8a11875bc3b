"""vLLM serving speed (CPU, or a GPU with a CUDA vLLM): vLLM's own attention against the MoBA plugin, in the same run.

    .venv-vllm/bin/python benchmarks/bench_serving.py --lengths 2048 4096 8192 [--moba '{"block_size": 512}' ...]
    .venv-vllm/bin/python benchmarks/bench_serving.py --lengths 2048 4096 --settings vllm dca dca+moba \
        --dca '{"pretraining_length": 1024}' --moba '{"block_size": 128, "top_k": 4, "decode": "full"}'

Settings: vllm (vLLM's own attention, plugin off), moba (--moba), dca (dense DCA: sparse = false with --dca),
dca+moba (--moba with --dca). For each setting one engine (a subprocess: vLLM starts processes) times, per
prompt length, time to first token (a request with max_tokens=1: the prefill), prefill tokens/s, and decode
tokens/s (the same prompt twice more, served from the prefix cache: 1 token, then 1 + N tokens; the
difference is N decode steps; --decode-repeats times per repeat, best and median). Before timing,
each plugin setting's greedy tokens on the first min(shortest length, 2048) tokens (inside the model's trained
window) are checked against the transformers path with the same MobaConfig. Rows go to a CSV with the machine,
versions, settings and date on each (benchmarks/results_serving.csv by default). Lengths above the model's 8K
context set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 and raise max_position_embeddings to the longest request, so vLLM's RoPE
table covers it (vLLM's own attention past the window: a cost baseline, not a quality one; DCA then needs
pretraining_length in --dca).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ("vllm", "moba", "dca", "dca+moba")


def engine_main(job_file: str, out_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**job["engine"])
    greedy = SamplingParams(max_tokens=job["verify_tokens"], temperature=0.0)
    verified = llm.generate([TokensPrompt(prompt_token_ids=job["verify"])], greedy)[0].outputs[0].token_ids
    out: dict = {"verify": list(verified)}
    rows = []
    for ids in job["prompts"]:
        first, steps = [], []
        for r in range(job["repeats"]):
            # a different first token per repeat keeps the prefix cache from serving the prompt
            variant = TokensPrompt(prompt_token_ids=[ids[0] + r + 1, *ids[1:]])
            t = time.perf_counter()
            llm.generate([variant], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            first.append(time.perf_counter() - t)
            # the same prompt again, now from the prefix cache: 1 token, then 1 + N; the difference is N decode steps
            for _ in range(job["decode_repeats"]):
                ends = []
                for new_tokens in (1, 1 + job["decode_tokens"]):
                    t = time.perf_counter()
                    done = llm.generate(
                        [variant], SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False,
                    )  # fmt: skip
                    ends.append(time.perf_counter() - t)
                    assert len(done[0].outputs[0].token_ids) == new_tokens
                steps.append((ends[1] - ends[0]) / job["decode_tokens"])
        rows.append({"tokens": len(ids), "ttft": first, "step": steps})
    out["rows"] = rows
    Path(out_file).write_text(json.dumps(out))


def run_engine(job: dict, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_file.write_text(json.dumps(job))
        # its own process group: stopping the benchmark (an error, Ctrl-C) stops vLLM's engine processes too
        proc = subprocess.Popen(
            [sys.executable, __file__, "--engine", str(job_file), str(out_file)],
            env={**os.environ, **env},
            start_new_session=True,
        )
        try:
            returncode = proc.wait()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group (orphaned workers)
        if returncode:
            raise subprocess.CalledProcessError(returncode, proc.args)
        return json.loads(out_file.read_text())


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        engine_main(sys.argv[2], sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument(
        "--moba", nargs="+", default=['{"block_size": 512, "top_k": 3}'],
        help="MobaConfig as JSON or a preset name; several: one engine each (moba#1, moba#2, ...); dca+moba: the first",
    )  # fmt: skip
    p.add_argument("--dca", default='{"pretraining_length": 4096}', help="DcaConfig as JSON (dca, dca+moba)")
    p.add_argument("--settings", nargs="+", default=["vllm", "moba"], choices=SETTINGS)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--decode-repeats", type=int, default=3, help="decode timings per prompt repeat (cheap: cached)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--csv", default=str(ROOT / "benchmarks" / "results_serving.csv"))
    args = p.parse_args()

    import torch
    import vllm
    from transformers import AutoTokenizer

    import moba_hf
    from moba_hf.eval.texts import generated_text
    from moba_hf.models import local_path

    mobas = [moba_hf.MobaConfig.from_spec(json.loads(m) if m.lstrip().startswith("{") else m) for m in args.moba]
    dca = moba_hf.DcaConfig.from_dict(json.loads(args.dca))
    configs = {"moba" if len(mobas) == 1 else f"moba#{i + 1}": config for i, config in enumerate(mobas)}
    configs.update({"dca": moba_hf.MobaConfig(sparse=False, dca=dca), "dca+moba": mobas[0].replace(dca=dca)})
    names = []  # one engine each
    for setting in args.settings:
        names += [n for n in configs if n.split("#")[0] == "moba"] if setting == "moba" else [setting]
    path = str(local_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    text_ids = tokenizer(generated_text(max(args.lengths), seed=0), add_special_tokens=False).input_ids
    prompts = [text_ids[:n] for n in args.lengths]
    # checked inside the model's trained 8K window: past it, greedy tokens at untrained positions are no stable check
    verify, verify_tokens = text_ids[: min(args.lengths[0], 2048)], 8
    max_len = max(args.lengths) + args.decode_tokens + 8
    engine = dict(
        model=path, dtype=args.dtype, max_model_len=max_len, enforce_eager=True, seed=0,
        max_num_batched_tokens=max_len, enable_prefix_caching=True,
    )  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = "3600"  # a one-shot long prefill on few cores: over 300 s
    overrides = {}
    if max_len > 8192:
        env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        overrides["max_position_embeddings"] = max_len  # vLLM's RoPE table must cover every position
    job = dict(prompts=prompts, verify=verify, verify_tokens=verify_tokens, repeats=args.repeats,
               decode_tokens=args.decode_tokens, decode_repeats=args.decode_repeats)  # fmt: skip
    results = {}
    for name in names:
        if name == "vllm":
            engine_env, hf_overrides = {**env, "VLLM_PLUGINS": "none"}, overrides
        else:
            engine_env, hf_overrides = env, {**overrides, "moba_config": configs[name].to_dict()}
        results[name] = run_engine({**job, "engine": {**engine, "hf_overrides": hf_overrides}}, engine_env)

    for name in names:
        if name == "vllm":
            continue
        config = configs[name]
        model = moba_hf.from_pretrained(path, moba=config, dtype=getattr(torch, args.dtype)).eval()
        with torch.inference_mode():
            ids = torch.tensor([verify])
            hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=verify_tokens, do_sample=False)
        hf_tokens = hf[0, len(verify) :].tolist()
        if results[name]["verify"] != hf_tokens[: len(results[name]["verify"])]:
            print(
                f"{name}: plugin != transformers path at {len(verify)} tokens: {results[name]['verify']} vs {hf_tokens}"
            )
            return 1
        print(f"verified: {name} greedy tokens == transformers path at {len(verify)} tokens ({config})")

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    machine = f"{platform.processor() or platform.machine()} x{os.cpu_count()}"
    out_rows = []
    header = ("tokens", "attention", "TTFT s", "prefill tok/s", "decode tok/s", "TTFT vs vLLM", "decode vs vLLM")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (7, 9, 8, 14, 13, 13, 15), strict=True)))
    for i, n in enumerate(args.lengths):
        base = results["vllm"]["rows"][i] if "vllm" in results else None
        base_ttft = min(base["ttft"]) if base else float("nan")
        base_step = statistics.median(base["step"]) if base else float("nan")
        for name in names:
            row = results[name]["rows"][i]
            ttft, step = min(row["ttft"]), statistics.median(row["step"])
            decode = 1 / step if step > 0 else float("nan")
            ratio, decode_ratio = base_ttft / ttft, base_step / step if step > 0 else float("nan")
            print(f"{n:>7} {name:>9} {ttft:8.2f} {n / ttft:14.0f} {decode:13.1f} {ratio:12.2f}x {decode_ratio:14.2f}x")
            out_rows.append(dict(
                date=stamp, machine=machine, torch=torch.__version__, vllm=vllm.__version__, dtype=args.dtype,
                attention=name, moba=str(configs[name]) if name in configs else "", tokens=n, repeats=args.repeats,
                ttft_s_min=round(ttft, 4), ttft_s_median=round(statistics.median(row["ttft"]), 4),
                prefill_tok_s=round(n / ttft, 1), decode_tok_s=round(decode, 2), ttft_speedup=round(ratio, 3),
                decode_step_s_min=round(min(row["step"]), 5), decode_step_s_median=round(step, 5),
                decode_speedup=round(decode_ratio, 3), decode_timings=len(row["step"]),
            ))  # fmt: skip
    out = Path(args.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    earlier = list(csv.DictReader(out.open(newline=""))) if out.is_file() else []
    fields = list(dict.fromkeys([*(earlier[0] if earlier else {}), *out_rows[0]]))  # columns added later: blank
    with out.open("w" if earlier and list(earlier[0]) != fields else "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if not earlier or list(earlier[0]) != fields:
            writer.writeheader()
            writer.writerows(earlier)
        writer.writerows(out_rows)
    print(f"rows appended to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
