"""Which MobaConfig a vLLM engine runs, and the refusals that keep a bad setup from starting.

One schema, three places, the first found wins:
  1. ``--hf-overrides '{"moba_config": {...}}'`` (or a preset name / file path as the value),
  2. ``MOBA_HF_CONFIG=<preset name or .toml/.json/.yaml file>`` in the environment,
  3. ``moba_config`` in the checkpoint's config.json (what ``save_pretrained`` writes).
None of them: the plugin stays out of the way and vLLM's own attention runs.

Every check runs when the engine builds its attention layers, before any request is accepted.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..config import MobaConfig, read_config_file
from ..integration.support import check_supported

logger = logging.getLogger("moba_hf")

ENV = "MOBA_HF_CONFIG"
# vLLM model classes the plugin runs: their attention layers hand the backend post-RoPE q / k of plain causal
# self-attention (the end-to-end tests run LlamaForCausalLM)
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# KV cache dtypes whose pages the MoBA kernels read as they are ("auto" = the model's dtype)
READABLE_CACHE_DTYPES = {"auto": None, "float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}


class MobaSetupError(ValueError):
    """A vLLM engine configuration the MoBA plugin refuses (raised at startup)."""


def _source(vllm_config: Any) -> tuple[Any, str] | None:
    model_config = vllm_config.model_config
    overrides = model_config.hf_overrides if isinstance(model_config.hf_overrides, dict) else {}
    if "moba_config" in overrides:
        return overrides["moba_config"], "--hf-overrides moba_config"
    env = os.environ.get(ENV)
    if env:
        return env, f"{ENV}={env}"
    raw = getattr(model_config.hf_config, "moba_config", None)
    if raw is not None:
        return raw, "the checkpoint's config.json moba_config"
    return None


def resolve(vllm_config: Any) -> tuple[MobaConfig, dict[str, Any], str] | None:
    """(config, serving options, where it came from), or None when no MoBA config is given anywhere."""
    found = _source(vllm_config)
    if found is None:
        return None
    raw, where = found
    serving: dict[str, Any] = {}
    try:
        if isinstance(raw, str) and os.path.isfile(raw):
            settings = read_config_file(raw)  # a server file may also carry kv_cache_dtype / max_context_tokens
            config, serving = settings.moba, settings.serving
        else:
            config = MobaConfig.from_spec(raw)
    except (ValueError, FileNotFoundError) as err:
        raise MobaSetupError(f"moba_hf: bad MoBA config from {where}: {err}") from None
    return config, serving, where


def check(vllm_config: Any, config: MobaConfig, serving: dict[str, Any], where: str) -> frozenset[int]:
    """Refuse what the plugin cannot serve exactly; return the dense (full-attention) layer indices."""
    model_config = vllm_config.model_config
    hf_config = model_config.hf_text_config
    architectures = list(getattr(model_config, "architectures", None) or [])
    if not set(architectures) & set(ARCHITECTURES):
        raise MobaSetupError(
            f"moba_hf: the vLLM plugin supports {', '.join(ARCHITECTURES)}; this checkpoint is "
            f"{', '.join(architectures) or 'of unknown architecture'} (MoBA config from {where})"
        )
    try:
        check_supported(hf_config)
    except ValueError as err:
        raise MobaSetupError(f"moba_hf (MoBA config from {where}): {err}") from None
    window = model_config.get_sliding_window()
    if window is not None:
        raise MobaSetupError(
            f"moba_hf: sliding-window attention (window {window}) cannot be combined with MoBA; "
            "serve a checkpoint whose layers are all full attention"
        )
    if config.dca not in (None, False):
        raise MobaSetupError(
            f"moba_hf: the vLLM plugin does not run Dual Chunk Attention (dca={config.dca} from {where}); "
            "set dca = false or use the transformers path"
        )
    if getattr(hf_config, "dual_chunk_attention_config", None) and config.dca is None:
        raise MobaSetupError(
            "moba_hf: this checkpoint carries dual_chunk_attention_config, which the vLLM plugin does not run; "
            "set dca = false in the MoBA config to serve it without DCA"
        )
    cache_dtype = vllm_config.cache_config.cache_dtype
    model_dtype = str(model_config.dtype).removeprefix("torch.")
    readable = READABLE_CACHE_DTYPES.get(cache_dtype, "unreadable")
    if readable not in (None, model_dtype):
        raise MobaSetupError(
            f"moba_hf: kv_cache_dtype={cache_dtype!r} is not readable by the MoBA kernels with a {model_dtype} "
            "model; use --kv-cache-dtype auto (the model's dtype)"
        )
    wanted = serving.get("kv_cache_dtype")
    if wanted is not None and wanted not in (cache_dtype, model_dtype):
        raise MobaSetupError(
            f"moba_hf: {where} asks for kv_cache_dtype={wanted!r} but vLLM runs {cache_dtype!r} "
            f"({model_dtype} model); start vLLM with --kv-cache-dtype {wanted} or drop the setting"
        )
    limit = serving.get("max_context_tokens")
    if limit is not None and model_config.max_model_len > int(limit):
        raise MobaSetupError(
            f"moba_hf: {where} allows max_context_tokens={limit} but vLLM runs max_model_len="
            f"{model_config.max_model_len}; pass --max-model-len {limit}"
        )
    try:
        return config.full_layer_set(hf_config.num_hidden_layers)
    except ValueError as err:
        raise MobaSetupError(f"moba_hf: bad MoBA config from {where}: {err}") from None


def describe(config: MobaConfig, dense: frozenset[int], where: str) -> str:
    return f"moba_hf: vLLM attention runs {config} from {where}; dense layers {sorted(dense) or 'none'}"


__all__ = ["ARCHITECTURES", "ENV", "MobaSetupError", "check", "describe", "resolve"]
