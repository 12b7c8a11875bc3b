"""Which MobaConfig an SGLang server runs, and the refusals that keep a bad setup from starting.

The sources and their order are every server plugin's (`serving.find_source`): SGLang's
``--json-model-override-args '{"moba_config": {...}}'``, then ``MOBA_HF_CONFIG``, then the checkpoint's
config.json. Every check runs when the model runner builds its attention backend, before the server accepts a
request: a refusal stops the server's start with the message.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from ..config import MobaConfig
from ..integration.support import check_supported
from ..options import kv_cache_dtype
from ..serving import ENV, MobaSetupError, dca_on, find_source, read_source

logger = logging.getLogger("moba_hf")

OVERRIDE_FLAG = "--json-model-override-args"
# SGLang model classes the plugin runs: their RadixAttention hands the backend post-RoPE q / k of plain causal
# self-attention (the end-to-end tests run LlamaForCausalLM)
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class Setup(NamedTuple):
    config: MobaConfig
    dense: frozenset[int]  # layer indices of full attention
    where: str  # the config's source, for messages


def resolve(model_config: Any) -> tuple[MobaConfig, dict[str, Any], str] | None:
    """(config, serving options, where it came from) from an SGLang `ModelConfig`, or None without one."""
    overrides = getattr(model_config, "model_override_args", None) or {}
    found = find_source(overrides, OVERRIDE_FLAG, model_config.hf_config, model_config.hf_text_config)
    if found is None:
        return None
    raw, where = found
    config, serving = read_source(raw, where)
    return config, serving, where


def check(
    model_config: Any, config: MobaConfig, serving: dict[str, Any], where: str, cache_dtype: torch.dtype
) -> frozenset[int]:
    """Refuse what the plugin cannot serve exactly; return the dense (full-attention) layer indices.
    cache_dtype: the dtype of SGLang's KV pool."""
    hf_config = model_config.hf_text_config
    architectures = list(getattr(model_config.hf_config, "architectures", None) or [])
    if not set(architectures) & set(ARCHITECTURES):
        raise MobaSetupError(
            f"moba_hf: the SGLang plugin supports {', '.join(ARCHITECTURES)}; this checkpoint is "
            f"{', '.join(architectures) or 'of unknown architecture'} (MoBA config from {where})"
        )
    try:
        check_supported(hf_config)
    except ValueError as err:
        raise MobaSetupError(f"moba_hf (MoBA config from {where}): {err}") from None
    if dca_on(config, hf_config):
        raise MobaSetupError(
            f"moba_hf: Dual Chunk Attention (from {where}) is not served by the SGLang plugin; serve it with "
            "dca = false, or use the vLLM plugin or the transformers path"
        )
    model_dtype = model_config.dtype
    if cache_dtype != model_dtype:
        raise MobaSetupError(
            f"moba_hf: SGLang's KV cache is {str(cache_dtype).removeprefix('torch.')} but the model runs "
            f"{str(model_dtype).removeprefix('torch.')}; the MoBA kernels read a cache in the model's dtype: start "
            "SGLang with --kv-cache-dtype auto (the default)"
        )
    if serving.get("kv_cache_dtype") is not None:
        spelled = serving["kv_cache_dtype"]
        try:
            wanted = kv_cache_dtype(spelled)
        except ValueError as err:
            raise MobaSetupError(f"moba_hf: {where}: {err}") from None
        runs = str(model_dtype).removeprefix("torch.")
        if wanted not in ("auto", runs):
            raise MobaSetupError(
                f"moba_hf: {where} asks for kv_cache_dtype={spelled!r} but SGLang's KV cache is {runs} (the "
                f"model's dtype): start SGLang with --dtype {wanted}, or drop "
                "kv_cache_dtype from the file"
            )
    limit = serving.get("max_context_tokens")
    if limit is not None and model_config.context_len > int(limit):
        raise MobaSetupError(
            f"moba_hf: {where} allows max_context_tokens={limit} but SGLang runs context_len="
            f"{model_config.context_len}; pass --context-length {limit}"
        )
    try:
        return config.full_layer_set(hf_config.num_hidden_layers)
    except ValueError as err:
        raise MobaSetupError(f"moba_hf: bad MoBA config from {where}: {err}") from None


def setup(model_config: Any, cache_dtype: torch.dtype) -> Setup | None:
    """The server's MoBA config, checked (refusals raise `MobaSetupError`), or None without one; logs it."""
    found = resolve(model_config)
    if found is None:
        return None
    config, serving, where = found
    dense = check(model_config, config, serving, where, cache_dtype)
    logger.warning(f"moba_hf: SGLang attention runs {config} from {where}; dense layers {sorted(dense) or 'none'}")
    return Setup(config, dense, where)


__all__ = ["ARCHITECTURES", "ENV", "OVERRIDE_FLAG", "MobaSetupError", "Setup", "check", "resolve", "setup"]
