"""What every server plugin (vLLM's, SGLang's) shares: where a server's MobaConfig comes from, and its refusal.

One schema, three places, the first found wins:
  1. the server's model-config override flag with a ``moba_config`` key (vLLM's ``--hf-overrides``, SGLang's
     ``--json-model-override-args``), whose value is a config dict, a preset name or a file path,
  2. ``MOBA_HF_CONFIG=<preset name or .toml/.json/.yaml file>`` in the environment,
  3. ``moba_config`` in the checkpoint's config.json (what ``save_pretrained`` writes).
A ``moba_config`` of null in the override flag turns MoBA off whatever the other two say.
None of them but Qwen's ``dual_chunk_attention_config`` in config.json (Qwen2.5-1M): dense DCA with its
settings, ``MobaConfig(sparse=False)``. None at all: the plugin stays out of the way and the server's own
attention runs.

Dual Chunk Attention (`dca_resolve`, `ServedDca`): a server's model rotates q and k with plain RoPE at each token's
index p in its sequence; the plugin's backend moves the new keys to ``p mod s`` before the server writes them to its
cache (so the cache holds DCA keys for every later step), the queries the same before they attend, and a sequence
longer than one chunk attends as `kernels.dual_chunk.dca_attention` (`core.attend`), dense or with MoBA::

    rotated at p  --move by (p mod s) - p-->  rotated at p mod s      (keys: once, before the cache write)
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from . import core, logs
from .config import MobaConfig, read_config_file
from .integration import rope_remap
from .integration.support import check_supported, rope_type
from .kernels.rope import rotate
from .options import kv_cache_dtype

ENV = "MOBA_HF_CONFIG"
# model classes the server plugins run: their attention layers hand the backend post-RoPE q / k of plain causal
# self-attention (the end-to-end tests run LlamaForCausalLM)
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
QWEN_DCA_SOURCE = "the checkpoint's dual_chunk_attention_config"


class MobaSetupError(ValueError):
    """A server configuration the MoBA plugin refuses (raised at startup, before any request)."""


def find_source(
    overrides: dict[str, Any], override_flag: str, hf_config: Any, text_config: Any
) -> tuple[Any, str] | None:
    """(the raw config, where it came from) from the first of the three places that has one, or None.

    overrides: the server's model-config overrides as a dict ({} without any); override_flag: how the server's
    user spells them (named in messages); hf_config: the checkpoint's config (its ``moba_config``);
    text_config: its language model's config (Qwen's ``dual_chunk_attention_config``)."""
    if "moba_config" in overrides:
        if overrides["moba_config"] is None:  # an explicit "no MoBA": the env's and the checkpoint's are not read
            logs.once(
                logging.WARNING,
                "moba_hf: %s moba_config is null, so MoBA is off and the server's own attention runs (%s and the "
                "checkpoint's moba_config are not read)",
                override_flag,
                ENV,
            )
            return None
        return overrides["moba_config"], f"{override_flag} moba_config"
    env = os.environ.get(ENV)
    if env:
        return env, f"{ENV}={env}"
    raw = getattr(hf_config, "moba_config", None)
    if raw is not None:
        return raw, "the checkpoint's config.json moba_config"
    if rope_remap.qwen_dca_block(text_config) is not None:
        return {"sparse": False}, QWEN_DCA_SOURCE  # dca=None reads the block, as the transformers path does
    return None


def read_source(raw: Any, where: str) -> tuple[MobaConfig, dict[str, Any]]:
    """(config, serving options) of a raw config (dict, preset name or file path); a bad one raises
    `MobaSetupError` naming `where`. A file may also carry serving options (kv_cache_dtype,
    max_context_tokens)."""
    try:
        if isinstance(raw, str) and os.path.isfile(raw):
            settings = read_config_file(raw)
            return settings.moba, settings.serving
        return MobaConfig.from_spec(raw), {}
    except (ValueError, FileNotFoundError) as err:
        raise MobaSetupError(f"moba_hf: bad MoBA config from {where}: {err}") from None


def find_config(
    overrides: dict[str, Any], override_flag: str, hf_config: Any, text_config: Any
) -> tuple[MobaConfig, dict[str, Any], str] | None:
    """(config, serving options, where it came from) from the first place that has one (`find_source`), or None;
    a bad config raises `MobaSetupError` naming its place."""
    found = find_source(overrides, override_flag, hf_config, text_config)
    if found is None:
        return None
    raw, where = found
    config, serving = read_source(raw, where)
    return config, serving, where


def check_model(server: str, architectures: list[str], text_config: Any, where: str) -> None:
    """Refuse a checkpoint the plugin of `server` ("vLLM") cannot serve exactly: its model class (`architectures`),
    and what `integration.support.check_supported` reads in its language model's config."""
    if not set(architectures) & set(ARCHITECTURES):
        raise MobaSetupError(
            f"moba_hf: the {server} plugin supports {', '.join(ARCHITECTURES)}; this checkpoint is "
            f"{', '.join(architectures) or 'of unknown architecture'} (MoBA config from {where})"
        )
    try:
        check_supported(text_config)
    except ValueError as err:
        raise MobaSetupError(f"moba_hf (MoBA config from {where}): {err}") from None


def dense_layers(config: MobaConfig, text_config: Any, where: str) -> frozenset[int]:
    """The indices of the model's full-attention layers under `config`."""
    try:
        return config.full_layer_set(text_config.num_hidden_layers)
    except ValueError as err:
        raise MobaSetupError(f"moba_hf: bad MoBA config from {where}: {err}") from None


def check_serving_options(
    serving: dict[str, Any],
    where: str,
    *,
    server: str,
    cache_dtype: str,
    cache_note: str,
    context: tuple[str, int, str],
) -> None:
    """Refuse a server file's serving options (`kv_cache_dtype`, `max_context_tokens`) that the running server
    contradicts. server: its name in messages ("vLLM"); cache_dtype: the dtype its KV cache holds (the model's,
    as vLLM names dtypes); cache_note: how it came to that dtype; context: (the server's name for its context
    length, its value, the flag that sets it)."""
    spelled = serving.get("kv_cache_dtype")
    if spelled is not None:
        try:  # the file's spelling (fp16, half, bf16 ...) as vLLM names it
            wanted = kv_cache_dtype(spelled)
        except ValueError as err:
            raise MobaSetupError(f"moba_hf: {where}: {err}") from None
        if wanted not in ("auto", cache_dtype):
            asked = repr(wanted) if spelled == wanted else f"{spelled!r} ({wanted})"
            raise MobaSetupError(
                f"moba_hf: {where} asks for kv_cache_dtype={asked} but {server}'s KV cache is {cache_dtype} "
                f"({cache_note}), and the MoBA kernels read a cache in the model's dtype: start {server} with "
                f"--dtype {wanted} (the cache follows it with --kv-cache-dtype auto, the default), or drop "
                "kv_cache_dtype from the file"
            )
    limit = serving.get("max_context_tokens")
    name, length, flag = context
    if limit is not None and length > int(limit):
        raise MobaSetupError(
            f"moba_hf: {where} allows max_context_tokens={limit} but {server} runs {name}={length}; pass {flag} {limit}"
        )


def dca_on(config: MobaConfig, text_config: Any) -> bool:
    """DCA from the MoBA config, or (none there) from the checkpoint's dual_chunk_attention_config."""
    return config.dca is not False and (config.dca is not None or rope_remap.qwen_dca_block(text_config) is not None)


@dataclasses.dataclass(frozen=True)
class ServedDca(core.Dca):
    """`core.Dca` and the moves of a server's flat runs of new tokens to their DCA positions."""

    def deltas(self, query_start_loc: Sequence[int], seq_lens: Sequence[int]) -> torch.Tensor:
        """(tokens,) int64: how far each new token moves, from its index p in its sequence to p mod s.

        The new tokens of sequence i are the last (query_start_loc[i+1] - query_start_loc[i]) of its
        seq_lens[i] positions.
        """
        starts = torch.as_tensor(query_start_loc, dtype=torch.long)
        ends = starts[1:]
        owner = torch.repeat_interleave(torch.arange(len(ends)), ends - starts[:-1])
        p = torch.as_tensor(seq_lens, dtype=torch.long)[owner] - ends[owner] + torch.arange(int(starts[-1]))
        return p % self.params.chunk_size - p

    def move(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """x: (tokens, heads, D) rotated at p -> rotated at p + delta (delta: (tokens,) or fewer: the first
        len(delta) rows move, the rest, a server's padding, stays)."""
        n = delta.shape[0]
        work = torch.float64 if x.dtype == torch.float64 else torch.float32  # one rounding back to x's dtype
        moved = rotate(x[:n], delta[:, None], self.inv_freq, work).to(x.dtype)
        return moved if n == x.shape[0] else torch.cat([moved, x[n:]])


def dca_resolve(
    config: MobaConfig, text_config: Any, where: str, server: str, rope_types: Sequence[str]
) -> ServedDca | None:
    """DCA's parameters against the model (as the transformers path resolves them), or None when off.

    text_config: the language model's transformers config; server: the server's name (for messages);
    rope_types: the rope types whose frequencies the server computes as transformers does (the moves rotate the
    server's plain-RoPE q / k with transformers' frequencies). Refusals raise `MobaSetupError` naming `where`."""
    if not dca_on(config, text_config):
        return None
    rope = rope_type(text_config)
    if rope not in rope_types:
        raise MobaSetupError(
            f"moba_hf: DCA (from {where}) in {server} supports the rope types {', '.join(rope_types)}; this "
            f"model's is {rope!r}. Serve it without DCA (dca = false) or use the transformers path"
        )
    try:
        params = rope_remap.resolve(config.dca, text_config, config.block_size if config.sparse else None)
    except ValueError as err:
        raise MobaSetupError(f"moba_hf: DCA (from {where}): {err}") from None
    return ServedDca(params, rope_remap.config_inv_freq(text_config))


def attention_plan(config: MobaConfig, text_config: Any, where: str, dca: ServedDca | None) -> core.AttentionPlan:
    """The `core.AttentionPlan` a server's attention runs: `config` over the model's layers, with DCA as
    `dca_resolve` resolved it (None: off). What the plugin's routing and per-sequence attention read; a bad
    config raises `MobaSetupError` naming `where`."""
    try:
        return core.plan_for(config, text_config.num_hidden_layers, None if dca is None else dca.params)
    except ValueError as err:
        raise MobaSetupError(f"moba_hf: bad MoBA config from {where}: {err}") from None


def dca_describe(dca: ServedDca) -> str:
    """DCA's parameters for a server's startup line."""
    p = dca.params
    return (
        f"Dual Chunk Attention: pretraining_length c={p.pretraining_length}, chunk_size s={p.chunk_size}, "
        f"temperature {'on' if p.temperature else 'off'}"
    )


__all__ = [
    "ARCHITECTURES",
    "ENV",
    "QWEN_DCA_SOURCE",
    "MobaSetupError",
    "ServedDca",
    "attention_plan",
    "check_model",
    "check_serving_options",
    "dca_describe",
    "dca_on",
    "dca_resolve",
    "dense_layers",
    "find_config",
    "find_source",
    "read_source",
]
