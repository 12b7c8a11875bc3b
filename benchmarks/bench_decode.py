"""Decode speed: MoBA's sparse decode step vs SDPA's dense step, for the attention op and for whole-model `generate`.

    .venv/bin/python benchmarks/bench_decode.py                          # op 2K..128K, SmolLM2 at 8K and 16K
    .venv/bin/python benchmarks/bench_decode.py --model-contexts         # op only
    .venv/bin/python benchmarks/bench_decode.py --loads idle             # without the busy run
    .venv/bin/python benchmarks/bench_decode.py --threads 1              # op rows at one thread only
    .venv/bin/python benchmarks/bench_decode.py --op-contexts --settings default --loads idle \
        --model-contexts 4096 8192 16384 --new-tokens 4 --rounds 2    # whole-model steps only

`decode = "moba"` attends MoBA's blocks at every decode step, whatever the cache length; this script times that step.
Every setting is checked first, then timed idle (nothing added; other jobs on a shared machine still run) and busy
(`--busy` CPU-bound processes beside the timing), MoBA and SDPA alternated so both see the same load; each row
gives min and median of both and the ratios SDPA / MoBA of the mins ("best") and of the medians (> 1: MoBA is
faster). Settings: "default" (block 512, top 3, mean gate; --block-size / --top-k change it) and "training-free"
(the preset's gate: block 64, top 5, bound gate, sink and local block, with decode = "moba" (the preset itself decodes
densely); at model level its layers 0 and 1 are dense).

Op: one decode step of one layer with SmolLM2's heads (B=1, Hq=9, Hkv=3, D=64, float32). MoBA = append the new key
to the layer's block state + its pooled keys + `decode_plan` (gate + the selected blocks), what decode="moba" runs
per layer; SDPA = `F.scaled_dot_product_attention` over the whole cache (the same contiguous float32 tensors).
Checked against `moba_attention_reference` (and SDPA against dense attention) before timing. Timed at each
`--threads` setting ("default": torch's own choice on this machine; a number: torch.set_num_threads), idle and busy.
Each op row prints the read limit beside its ratios: context / the keys a step reads at most ((top_k + sink_blocks +
local_blocks) blocks), the speed-up of a step whose cost is only its reads (e.g. 16K / 1,536 keys = 10.7x); and
the keys the step reads per KV head (`kv_keys_read`: the blocks any of its query heads selected, each read once) with
context / those keys: with grouped-query attention a KV head reads the blocks of all its query heads' picks.

Model: SmolLM2-135M (30 layers), greedy decode steps after a context of N tokens, one token at a time, per cache
(`--caches`): "dynamic" (transformers' DynamicCache, which copies the whole cache at every step: that cost is in
both), "static" (its StaticCache, pre-allocated for N + the steps, written in place), "compiled" (the static step
under `torch.compile`, inductor; compiling takes minutes on a small CPU) and, not by default, "cudagraphs" (compiled
with mode="reduce-overhead": on a GPU the step is captured and replayed as a CUDA graph; on a CPU it is "compiled"
again) and "captured" (compiled, MoBA's one-token steps as `kernels.graph_step`'s device ops on any device: on a GPU
what "compiled" runs, on a CPU the alternative to the op's native step). MoBA and SDPA run in the same cache
setting, --rounds rounds each, alternated: a fresh cache filled synthetically (random keys/values at every layer,
the same for both: a real 16K prefill takes minutes on a small CPU), 2 untimed steps, then --new-tokens timed ones;
at every thread count of --model-threads (0: torch's default). Checked first: one cached sparse step's logits equal
the prefill path's on the same cache, and the greedy tokens of every cache kind are equal (MoBA's, and SDPA's).
Each row carries the read limit: cache keys / the most keys a sparse step reads (the op's ceiling on the ratio), and
the attention-free limit: SDPA's median step over the median step of the same model whose attention computes nothing
(timed in the same rounds), the ratio a free attention would reach: the rest of the model bounds every ratio; and
the read-bound limit: SDPA's median over the free step plus SDPA's attention time scaled to the keys a sparse step
reads per KV head (measured on one step of the same cache), the ratio of a sparse step that reads its keys at SDPA's
speed per key and costs nothing else.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_attention import append_rows, busy  # noqa: E402

from moba_hf import MobaConfig  # noqa: E402
from moba_hf.integration import cache as moba_cache  # noqa: E402
from moba_hf.kernels import BlockPlan, moba_attention_reference  # noqa: E402
from moba_hf.kernels.decode import decode_plan  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
DEFAULT_THREADS = torch.get_num_threads()  # torch's choice for this machine, before --threads


def _cache_keyword() -> str:
    from transformers import LlamaForCausalLM

    params = inspect.signature(LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x


def setting(name: str, block_size: int, top_k: int) -> MobaConfig:
    """The timed setting: a preset's gate with decode = "moba" (this script times the sparse step, whatever decode
    mode the preset ships with)."""
    if name == "default":
        return MobaConfig(block_size=block_size, top_k=top_k)
    return MobaConfig.preset(name).replace(decode="moba")


def timing_fields(t_moba: list[float], t_sdpa: list[float]) -> dict[str, float]:
    """Min / median of both sides in ms and the speed-ups (SDPA time / MoBA time), for one CSV row."""
    return {
        "moba_min_ms": round(min(t_moba) * 1e3, 4),
        "moba_median_ms": round(statistics.median(t_moba) * 1e3, 4),
        "sdpa_min_ms": round(min(t_sdpa) * 1e3, 4),
        "sdpa_median_ms": round(statistics.median(t_sdpa) * 1e3, 4),
        "speedup_best": round(min(t_sdpa) / min(t_moba), 3),
        "speedup_median": round(statistics.median(t_sdpa) / statistics.median(t_moba), 3),
    }


def timed_pair(first, second, repeats: int, warmup: int = 3, sync=None) -> tuple[list[float], list[float]]:
    """Alternate the two calls so both see the same machine load; `sync` (e.g. torch.cuda.synchronize) ends each
    timed call on a device that runs asynchronously."""
    for _ in range(warmup):
        first()
        second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((first, times[0]), (second, times[1])):
            if sync is not None:
                sync()
            t = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            out.append(time.perf_counter() - t)
    return times


# --- op level -----------------------------------------------------------------------------------------------------
def read_limit(moba: MobaConfig, context: int) -> float:
    """context / the most keys a decode step reads (its own block, top_k - 1 gated, the sink and local blocks)."""
    blocks = moba.top_k + moba.sink_blocks + moba.local_blocks
    return round(context / min(context, blocks * moba.block_size), 2)


def kv_keys_read(selected: torch.Tensor, context: int, block_size: int, kv_heads: int) -> float:
    """The keys a step reads per KV head (mean over rows and heads): the blocks any of the head's query heads
    selected (selected: bool [B, Hq, 1, n_blocks]), each read once for all of them, the last one partly filled. A
    KV head serving several query heads that pick different blocks reads up to that many times the keys of one."""
    b, hq, _, nb = selected.shape
    lengths = torch.full((nb,), float(block_size))
    lengths[-1] = context - (nb - 1) * block_size
    read = selected.reshape(b, kv_heads, hq // kv_heads, nb).any(2).to(lengths.dtype) @ lengths
    return float(read.mean())


def read_bound_limit(sdpa_ms: float, free_ms: float, keys_read: float, context: int) -> float:
    """SDPA's step over a step whose attention reads only `keys_read` of the `context` keys per KV head at SDPA's
    speed per key: the ratio a sparse step bound by its reads reaches (the rest of the model as the free step's)."""
    return round(sdpa_ms / (free_ms + (sdpa_ms - free_ms) * keys_read / context), 3)


def thread_settings(names: list[str]) -> list[tuple[str, int]]:
    """--threads values as (label, thread count): "default" is torch's choice at start-up."""
    default = torch.get_num_threads()
    out = []
    for name in names:
        if name == "default":
            out.append((f"{default} (default)", default))
        elif name.isdigit() and int(name) >= 1:
            out.append((name, int(name)))
        else:
            raise SystemExit(f"--threads takes 'default' or thread counts >= 1, got {name!r}")
    return out


class OpCase:
    """One layer's decode step over a cache of `context` keys (float32, on `device`, `heads` = (query heads, KV
    heads, head dim)), checked against the reference."""

    def __init__(self, moba: MobaConfig, context: int, device: str = "cpu", heads=(HEADS, KV_HEADS, HEAD_DIM)) -> None:
        hq, hkv, d = heads
        gen = torch.Generator().manual_seed(context)
        self.q = torch.randn(1, hq, 1, d, generator=gen).to(device)
        self.k, self.v = (torch.randn(1, hkv, context, d, generator=gen).to(device) for _ in range(2))
        self.plan = moba.plan(1)  # a decode step's
        self.new_key = self.k[:, :, -1:]
        state = moba_cache.BlockState(self.k, moba.block_size, moba.pooling)
        state.append(self.k[:, :, :-1], None)
        self.state = state
        self.error = self.check(moba)
        _, selected = decode_plan(self.q, self.k, self.v, self.state.block_keys(), self.plan, return_selection=True)
        self.kv_keys_read = kv_keys_read(selected, context, moba.block_size, hkv)

    def check(self, moba: MobaConfig) -> float:
        self.state.append(self.new_key, None)  # the exact cache: pooled keys of all `context` keys
        got = decode_plan(self.q, self.k, self.v, self.state.block_keys(), self.plan)
        want = moba_attention_reference(self.q, self.k, self.v, self.plan)
        tol = 2 * (self.k.shape[2] + self.k.shape[3]) * torch.finfo(torch.float32).eps  # rounding of the sums
        error = float((got - want).abs().max())
        if not error <= tol:
            raise AssertionError(f"decode_plan differs from the reference by {error:.2e} (> {tol:.2e})")
        dense = moba_attention_reference(self.q, self.k, self.v, BlockPlan(self.k.shape[2], 1))
        torch.testing.assert_close(self.sdpa(), dense, rtol=tol, atol=tol)
        return error

    def moba(self) -> torch.Tensor:
        # the state keeps growing by the new key (later blocks are ignored by the kernel): the cost of a real step
        self.state.append(self.new_key, None)
        return decode_plan(self.q, self.k, self.v, self.state.block_keys(), self.plan)

    def sdpa(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.q, self.k, self.v, enable_gqa=True)


# --- whole model ----------------------------------------------------------------------------------------------------
# the caches a whole-model step is timed with: transformers' DynamicCache (copies the whole cache at every step), its
# StaticCache (pre-allocated, written in place) and the StaticCache step under torch.compile (inductor)
CACHES = ("dynamic", "static", "compiled", "cudagraphs", "captured")
# torch.compile's mode per compiled kind ("captured": the default mode, the captured step on any device)
COMPILE_MODES = {"compiled": None, "cudagraphs": "reduce-overhead", "captured": None}
WARMUP_STEPS = 2  # untimed steps after the cache is filled: MoBA's block state is built at the first


def filled_cache(model, kind: str, context: int, capacity: int, seed: int = 0):
    """A cache of `kind` holding `context` random keys / values at every layer (the same for MoBA and SDPA: a real
    16K prefill takes minutes on a small CPU), with room for `capacity` tokens when it is pre-allocated."""
    from transformers import DynamicCache, StaticCache

    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    if kind == "dynamic":
        cache = DynamicCache(config=cfg)
    else:
        cache = StaticCache(config=cfg, max_cache_len=capacity)
    shape = (1, cfg.num_key_value_heads, context, cfg.hidden_size // cfg.num_attention_heads)
    for layer in range(cfg.num_hidden_layers):
        k, v = (torch.randn(shape, generator=gen).to(model.device, model.dtype) for _ in range(2))
        cache.update(k, v, layer)
    return cache


class ModelDecode:
    """Greedy decode steps of `forward` (a model, or its compiled call) over a cache of `kind` filled with `context`
    tokens, room for `steps` more: what a step of `generate` runs, one token at a time, without its bookkeeping."""

    def __init__(self, model, forward, kind: str, context: int, steps: int) -> None:
        self.forward = forward
        self.cache = filled_cache(model, kind, context, context + steps)
        self.device = model.device
        self.token = torch.tensor([[7]], device=self.device)
        self.position = context
        self.tokens: list[int] = []

    def step(self) -> None:
        """One step, finished when it returns: the next token is read back (a device sync on a GPU)."""
        position = torch.tensor([[self.position]], device=self.device)
        with torch.no_grad():
            out = self.forward(
                input_ids=self.token, position_ids=position, **{_cache_keyword(): self.cache}, use_cache=True
            )
        self.token = out.logits[:, -1:].argmax(-1)
        self.position += 1
        self.tokens.append(int(self.token))


def model_forwards(model, caches: list[str]) -> dict[str, object]:
    """The callable each cache kind steps: the model, or (compiled, cudagraphs) `torch.compile(model)` of a copy, so
    that the eager rows run no compiled code. A step over a StaticCache is one graph; where
    a model breaks the graph per layer, its frames compile once per layer (transformers' `layer_idx`): the recompile
    limit is raised to hold them all."""
    import copy

    forwards = {kind: model for kind in caches if kind not in COMPILE_MODES}
    for kind in set(caches) & set(COMPILE_MODES):
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, 4 * model.config.num_hidden_layers
        )
        forwards[kind] = torch.compile(copy.deepcopy(model), mode=COMPILE_MODES[kind])
    if "captured" in forwards:
        forwards["captured"] = captured(forwards["captured"], model.device.type)
    return forwards


def captured(forward, device_type: str):
    """`forward` with one-token steps over a StaticCache captured on `device_type` too (`kernels.graph_step`, what a
    GPU runs; on a CPU the op's native step is the default), for its calls only: the other kinds keep the default."""
    from moba_hf.integration import cache as moba_cache

    def step(**kwargs):
        default = moba_cache.GRAPH_STEP_DEVICES
        moba_cache.GRAPH_STEP_DEVICES = default | {device_type}
        try:
            return forward(**kwargs)
        finally:
            moba_cache.GRAPH_STEP_DEVICES = default

    return step


def check_model_tokens(forwards: dict[str, object], model, context: int, tokens: int) -> list[int]:
    """Greedy tokens over the same filled cache with every cache kind: equal, or raise (the first call of the
    compiled forward compiles it: minutes on a small CPU)."""
    got = {}
    for kind, forward in forwards.items():
        run = ModelDecode(model, forward, kind, context, WARMUP_STEPS + tokens)
        for _ in range(WARMUP_STEPS + tokens):
            run.step()
        got[kind] = run.tokens
    first = next(iter(got.values()))
    if any(t != first for t in got.values()):
        raise AssertionError(f"greedy tokens differ between caches at context {context}: {got}")
    return first


def model_step_times(
    moba_forward, sdpa_forward, models, kind: str, context: int, tokens: int, rounds: int, free=None
) -> tuple[list[float], ...]:
    """Per-step seconds of MoBA and SDPA (and of `free` = (forward, model), the attention-free step, when given):
    `rounds` times a fresh filled cache, WARMUP_STEPS untimed steps, then `tokens` timed steps, the sides' rounds
    alternated so all see the same load."""
    sides = [(moba_forward, models[0]), (sdpa_forward, models[1])] + ([free] if free is not None else [])
    times: tuple[list[float], ...] = tuple([] for _ in sides)
    for _ in range(rounds):
        for (forward, model), out in zip(sides, times, strict=True):
            run = ModelDecode(model, forward, kind, context, WARMUP_STEPS + tokens)
            for _ in range(WARMUP_STEPS):
                run.step()
            for _ in range(tokens):
                t = time.perf_counter()
                run.step()
                out.append(time.perf_counter() - t)
    return times


FREE_ATTENTION = "bench_attention_free"


def attention_free(module, query, key, value, attention_mask, **kwargs):
    """An attention function that computes nothing (zeros): a step with it costs what everything but attention
    costs (weights, projections, MLP, the cache write), so SDPA's step time over it bounds any attention's ratio."""
    b, _, nq, d = query.shape
    return query.new_zeros(b, nq, query.shape[1], d), None


def attention_free_model(sdpa):
    """A copy of the SDPA model whose attention computes nothing (registered once, masks as SDPA's)."""
    import copy

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(FREE_ATTENTION, attention_free)
    AttentionMaskInterface.register(FREE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    free = copy.deepcopy(sdpa)
    free.set_attn_implementation(FREE_ATTENTION)
    return free


def verify_model_step(model, context: int) -> float:
    """One sparse decode step's logits == the uncached MoBA path on the same cache; returns the max logit
    difference relative to the largest logit."""
    tok, pos = torch.tensor([[7]]), torch.tensor([[context]])
    keyword = _cache_keyword()
    for layer in model.model.layers:  # normally installed by the first moba call
        moba_cache.install_hooks(layer.self_attn)
    with torch.no_grad():
        sparse = model(tok, **{keyword: filled_cache(model, "dynamic", context, 0)}, position_ids=pos, use_cache=True)
        limit, moba_cache.DECODE_MAX_QUERIES = moba_cache.DECODE_MAX_QUERIES, 0  # the prefill kernel instead
        try:
            ref = model(tok, **{keyword: filled_cache(model, "dynamic", context, 0)}, position_ids=pos, use_cache=True)
        finally:
            moba_cache.DECODE_MAX_QUERIES = limit
    diff = float((sparse.logits - ref.logits).abs().max() / ref.logits.abs().max())
    if not diff < 1e-4:  # float32 rounding; a different block choice would move logits far more
        raise AssertionError(f"sparse decode logits differ from the reference path by {diff:.2e} (relative)")
    return diff


def model_kv_keys_read(model, context: int) -> float:
    """The keys a sparse step of `model` reads per KV head over a fresh synthetic cache of `context` tokens (mean over
    its sparse layers; `kv_keys_read`), from one step whose selections are asked for."""
    from moba_hf import core

    reads = []
    real = core.decode

    def decode(q, cache, block_keys, plan, scale, **kwargs):
        out, selected = real(q, cache, block_keys, plan, scale, **{**kwargs, "return_selection": True})
        reads.append(kv_keys_read(selected, context + 1, plan.block_size, block_keys.shape[1]))
        return (out, selected) if kwargs.get("return_selection") else out

    core.decode = decode
    try:
        ModelDecode(model, model, "static", context, 1).step()
    finally:
        core.decode = real
    if not reads:
        raise AssertionError(f"no sparse decode step ran at context {context}")
    return statistics.mean(reads)


def model_rows(args, settings: dict[str, MobaConfig]) -> list[dict]:
    """SmolLM2 decode steps, MoBA vs SDPA in the same cache setting, for every setting, context, cache kind, thread
    count and load; the tokens of every cache kind checked equal first."""
    import copy

    import moba_hf
    from moba_hf.models import load as load_model

    sdpa, _ = load_model("smollm2")
    free = attention_free_model(sdpa)
    free_forwards = model_forwards(free, args.caches)
    rows = []
    for name, moba in settings.items():
        model = moba_hf.apply(copy.deepcopy(sdpa), moba)
        moba_forwards, sdpa_forwards = model_forwards(model, args.caches), model_forwards(sdpa, args.caches)
        for context in args.model_contexts:
            diff = verify_model_step(model, context)
            keys_read = model_kv_keys_read(model, context)
            for label, forwards, m in (("moba", moba_forwards, model), ("sdpa", sdpa_forwards, sdpa)):
                tokens = check_model_tokens(forwards, m, context, args.new_tokens)
                print(f"check model {name} {context} {label}: {'/'.join(forwards)} caches give tokens {tokens}")
            print(f"check model {name} {context}: sparse step vs prefill path, relative logit difference {diff:.1e}")
            for threads in args.model_threads:
                torch.set_num_threads(threads or DEFAULT_THREADS)
                for load_name in args.loads:
                    with busy(args.busy if load_name == "busy" else 0):
                        for kind in args.caches:
                            t_moba, t_sdpa, t_free = model_step_times(
                                moba_forwards[kind], sdpa_forwards[kind], (model, sdpa), kind, context,
                                args.new_tokens, args.rounds, free=(free_forwards[kind], free),
                            )  # fmt: skip
                            free_ms = statistics.median(t_free) * 1e3
                            sdpa_ms = statistics.median(t_sdpa) * 1e3
                            rows.append(
                                {"bench": f"smollm2-step-{kind}", **setting_fields(name, moba), "context": context,
                                 "load": load_name, "threads": torch.get_num_threads(),
                                 **timing_fields(t_moba, t_sdpa), "read_limit": read_limit(moba, context),
                                 "free_median_ms": round(free_ms, 4), "free_limit": round(sdpa_ms / free_ms, 3),
                                 "kv_keys_read": round(keys_read, 1),
                                 "read_bound_limit": read_bound_limit(sdpa_ms, free_ms, keys_read, context + 1),
                                 "check": f"{diff:.1e}"}
                            )  # fmt: skip
                            print(rows[-1], flush=True)
        torch.set_num_threads(DEFAULT_THREADS)
    return rows


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def env() -> dict:
    return {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "device": f"cpu ({cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)",
        "dtype": "float32",
    }


def setting_fields(name: str, moba: MobaConfig) -> dict:
    return {
        "setting": name,
        "block_size": moba.block_size,
        "top_k": moba.top_k,
        "pooling": moba.pooling,
        "sink_blocks": moba.sink_blocks,
        "local_blocks": moba.local_blocks,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op-contexts", type=int, nargs="*", default=[2048, 4096, 8192, 16384, 32768, 131072])
    parser.add_argument("--model-contexts", type=int, nargs="*", default=[8192, 16384])
    parser.add_argument("--settings", nargs="+", default=["default", "training-free"])
    parser.add_argument("--loads", nargs="+", choices=["idle", "busy"], default=["idle", "busy"])
    parser.add_argument("--busy", type=int, default=1, help="CPU-bound processes beside the busy timing")
    parser.add_argument("--repeats", type=int, default=200, help="op-level repeats")
    parser.add_argument("--new-tokens", type=int, default=8, help="timed model steps per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating MoBA / SDPA rounds of model steps")
    parser.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES[:3]), help="model rows' caches")
    parser.add_argument(
        "--model-threads", type=int, nargs="+", default=[0, 1], help="model rows' torch threads (0: the default)"
    )
    parser.add_argument("--block-size", type=int, default=512, help='the "default" setting\'s block size')
    parser.add_argument("--top-k", type=int, default=3, help='the "default" setting\'s top_k')
    parser.add_argument(
        "--threads", nargs="+", default=["default", "1"],
        help="torch thread settings the op rows are timed at: 'default' (torch's choice) or counts; the model rows run "
        "at the first",
    )  # fmt: skip
    parser.add_argument("--csv", type=Path, default=ROOT / "benchmarks" / "decode.csv")
    args = parser.parse_args(argv)
    threads = thread_settings(args.threads)
    torch.set_num_threads(threads[0][1])  # the model rows' setting, which the "device" field reports
    torch.manual_seed(0)
    settings = {name: setting(name, args.block_size, args.top_k) for name in args.settings}
    command = " ".join(["python", *sys.argv])
    common = {**env(), "busy_processes": args.busy, "command": command}
    print(f"command: {command}\n{common}", flush=True)

    rows = []
    cases = {}  # checked before any timing
    for name, moba in settings.items():
        for context in args.op_contexts:
            cases[name, context] = case = OpCase(moba, context)
            print(f"check op {name} {context}: max abs error vs reference {case.error:.1e} -> ok", flush=True)
    for label, n_threads in threads:
        torch.set_num_threads(n_threads)
        for load_name in args.loads:
            with busy(args.busy if load_name == "busy" else 0):
                for (name, context), case in cases.items():
                    t_moba, t_sdpa = timed_pair(case.moba, case.sdpa, args.repeats)
                    rows.append(
                        {"bench": "op", **setting_fields(name, settings[name]), "context": context,
                         "threads": label, "load": load_name, **timing_fields(t_moba, t_sdpa),
                         "read_limit": read_limit(settings[name], context),
                         "kv_keys_read": round(case.kv_keys_read, 1),
                         "kv_read_limit": round(context / case.kv_keys_read, 2), "check": f"{case.error:.1e}"}
                    )  # fmt: skip
                    print(rows[-1], flush=True)
    torch.set_num_threads(threads[0][1])

    if args.model_contexts:
        rows += model_rows(args, settings)

    rows = [{**row, **common} for row in rows]
    append_rows(args.csv, rows)  # earlier runs' rows stay, each with its date and command
    print(f"\n{common}")
    print(
        "| bench | setting | context | threads | load | MoBA min / median ms | SDPA min / median ms | best | median "
        "| limit | median / limit | limit of the keys read |"
    )
    for row in rows:
        # op rows: the read limit; model rows: the attention-free limit (SDPA's median over a step without attention)
        limit = row.get("free_limit", row.get("read_limit"))
        beside = f"{limit:.1f}x | {row['speedup_median'] / limit:.0%}" if limit else "- | -"
        # what the step's reads allow: op rows context / keys read per KV head, model rows `read_bound_limit`
        beside += f" | {row.get('read_bound_limit', row.get('kv_read_limit')):.2f}x"
        print(
            f"| {row['bench']} | {row['setting']} | {row['context']} | {row.get('threads', '-')} | {row['load']} "
            f"| {row['moba_min_ms']:.2f} / {row['moba_median_ms']:.2f} | {row['sdpa_min_ms']:.2f} / "
            f"{row['sdpa_median_ms']:.2f} | {row['speedup_best']:.2f}x | {row['speedup_median']:.2f}x | {beside} |"
        )
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
