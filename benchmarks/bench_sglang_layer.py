"""One attention layer as SGLang serves it on CPU: SGLang's own `torch_native` extend against the MoBA plugin's
`moba_pool`, and `core.attend` on the same keys already laid out [B, H, N, D] (what the transformers path hands the
core), so the cost of reading SGLang's KV pool shows on its own.

    PYTHONPATH=$PWD:tests_sglang/stand_ins .venv-sglang/bin/python benchmarks/bench_sglang_layer.py \
        --tokens 16384 --dtype bfloat16 --threads 1

A layer of SmolLM2-135M (9 query heads, 3 KV heads, head dim 64) prefills one prompt of --tokens tokens whose keys
sit in shuffled pool slots (as after a server has served and freed other requests). The plugin's output is first
checked to equal `core.attend`'s; then each path runs --repeats times, interleaved, and the script prints the best
wall time and the best CPU time (process time: on a shared machine it moves far less with the load than the wall
time does). --threads 1 keeps every op on one core, so the CPU times add up to the work itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave torch's default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--moba", type=json.loads, default={"block_size": 512, "top_k": 3})
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.repeats < 1 or args.threads < 0:
        parser.error(f"--tokens must be >= 2, --repeats >= 1, --threads >= 0; got {args.tokens}, {args.repeats}, "
                     f"{args.threads}")  # fmt: skip
    sys.path.insert(0, str(ROOT))
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from moba_hf import MobaConfig, core
    from moba_hf.sglang.pool import moba_pool

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, n, hq, hkv, d = getattr(torch, args.dtype), args.tokens, 9, 3, 64
    scale = d**-0.5
    # the attention plan of one sparse layer (the one timed), in a model of 64 layers (room for full_attn_layers)
    plan = core.plan_for(MobaConfig.from_spec(args.moba), 64)
    gen = torch.Generator().manual_seed(0)
    k_buffer = torch.randn(n + 1, hkv, d, generator=gen).to(dtype)  # slot 0: SGLang's padding slot
    v_buffer = torch.randn(n + 1, hkv, d, generator=gen).to(dtype)
    req_to_token = torch.zeros(2, n, dtype=torch.int32)
    req_to_token[1] = torch.randperm(n, generator=gen, dtype=torch.int32) + 1
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    out = torch.empty_like(q)
    lens = torch.tensor([n])

    sglang = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)  # its extend reads none of the runner's state

    def native() -> None:
        sglang._run_sdpa_forward_extend(
            q, out, k_buffer, v_buffer, req_to_token, torch.tensor([1]), lens, torch.tensor([0]), lens,
            scaling=scale, enable_gqa=True, causal=True,
        )  # fmt: skip

    def plugin() -> None:
        moba_pool(q, out, k_buffer, v_buffer, req_to_token, req_pool_indices=[1], seq_lens=[n], extend_lens=[n],
                  plan=plan, scale=scale)  # fmt: skip

    slots = req_to_token[1].long()
    laid_out = [t.index_select(0, slots).transpose(0, 1).unsqueeze(0).contiguous() for t in (k_buffer, v_buffer)]
    q_laid_out = q.transpose(0, 1).unsqueeze(0).contiguous()

    def core_attend() -> torch.Tensor:
        return core.attend(q_laid_out, *laid_out, plan, scale, "moba")

    plugin()
    if not torch.equal(out, core_attend()[0].transpose(0, 1)):
        raise SystemExit("moba_pool's output differs from core.attend's on the same keys; nothing timed")
    runs = {"SGLang torch_native extend": native, "plugin moba_pool": plugin, "core.attend, keys laid out": core_attend}
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            w, c = time.perf_counter(), time.process_time()
            run()
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{n} tokens, {args.dtype}, {torch.get_num_threads()} threads, moba {json.dumps(args.moba)}, load {load}")
    base = min(cpu["SGLang torch_native extend"])
    for name in runs:
        print(f"{name:28s} best wall {min(wall[name]):7.3f} s   best CPU {min(cpu[name]):7.3f} s   "
              f"CPU vs torch_native {base / min(cpu[name]):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
