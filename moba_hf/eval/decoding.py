"""Timed greedy decoding: the prefill (first forward) timed on its own, its measured sparsity recorded, then
one token per forward from the KV cache."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from typing import Any

import torch

from ..integration import track_sparsity


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work, so a wall-clock reading covers it (CUDA; a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_kwargs(model: Any) -> tuple[str, bool]:
    """The cache keyword of model.forward ("cache" in transformers >= 5.2x, "past_key_values" before) and
    whether it takes logits_to_keep."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def output_cache(out: Any) -> Any:
    for name in ("cache", "past_key_values"):
        value = getattr(out, name, None)
        if value is not None:
            return value
    return None


@dataclasses.dataclass
class Decoded:
    tokens: list[int]  # the first row's generated tokens
    prefill_seconds: float  # the whole batch's prefill
    decode_seconds: float
    sparsity: float | None  # fraction of causal query-key pairs the prefill skipped (None: not tracked)
    sparsity_per_layer: dict[int, float]
    rows: list[list[int]] = dataclasses.field(default_factory=list)  # generated tokens of every row

    def measurements(self) -> dict[str, Any]:
        """The timing and sparsity fields every trial record carries."""
        return {
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "sparsity": self.sparsity,
            "sparsity_per_layer": self.sparsity_per_layer,
        }


@torch.no_grad()
def greedy_decode(
    model: Any,
    input_ids: torch.Tensor,
    max_new_tokens: int = 8,
    *,
    track: bool = True,
    eos_token_id: int | None = None,
) -> Decoded:
    """Greedy decoding of input_ids [batch, N] (rows of equal length, no padding); the prefill (first
    forward) is timed and, with `track`, its measured sparsity recorded (tracking recomputes the cheap
    block gate, inside the timed region). A single row stops at `eos_token_id`."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cache_kw, has_keep = forward_kwargs(model)
    extra = {"logits_to_keep": 1} if has_keep else {}
    device = input_ids.device
    with track_sparsity() if track else contextlib.nullcontext() as stats:
        sync_device(device)
        start = time.perf_counter()
        out = model(input_ids=input_ids, use_cache=True, **extra)
        sync_device(device)
        prefill = time.perf_counter() - start
    next_token = out.logits[:, -1:].argmax(-1)
    steps = [next_token]
    start = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        if eos_token_id is not None and input_ids.shape[0] == 1 and int(steps[-1]) == eos_token_id:
            break
        out = model(input_ids=next_token, use_cache=True, **{cache_kw: output_cache(out)}, **extra)
        next_token = out.logits[:, -1:].argmax(-1)
        steps.append(next_token)
    sync_device(device)
    decode = time.perf_counter() - start
    if stats is None or not stats.layers:
        sparsity, per_layer = (0.0, {}) if track else (None, {})
    else:
        sparsity, per_layer = stats.overall, stats.per_layer()
    rows = torch.cat(steps, dim=-1).tolist()
    return Decoded(rows[0], prefill, decode, sparsity, per_layer, rows)
