"""Which MobaConfig an SGLang server runs, and the refusals that keep a bad setup from starting.

The sources and their order are every server plugin's (`serving.find_source`): SGLang's
``--json-model-override-args '{"moba_config": {...}}'``, then ``MOBA_HF_CONFIG``, then the checkpoint's
config.json. Every check runs when the model runner builds its attention backend, before the server accepts a
request: a refusal stops the server's start with the message.

Dual Chunk Attention (a `dca` table in the MobaConfig, or Qwen's ``dual_chunk_attention_config`` in config.json)
is resolved here as the transformers path resolves it (`serving.dca_resolve`); SGLang's model rotates q and k with
plain RoPE (`rope.PlainRotaryEmbedding` stands in for SGLang's CUDA-only `DualChunkRotaryEmbedding`) and the
backend moves them to their DCA positions.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from ..config import MobaConfig
from ..integration import rope_remap
from ..integration.support import check_supported, rope_type
from ..options import kv_cache_dtype
from ..serving import ENV, MobaSetupError, ServedDca, dca_describe, dca_on, dca_resolve, find_source, read_source

logger = logging.getLogger("moba_hf")

OVERRIDE_FLAG = "--json-model-override-args"
# SGLang model classes the plugin runs: their RadixAttention hands the backend post-RoPE q / k of plain causal
# self-attention (the end-to-end tests run LlamaForCausalLM)
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# DCA moves keys SGLang rotated with transformers' frequencies of the same rope type: the types where both
# libraries compute the same frequencies
DCA_ROPE_TYPES = ("default", "llama3")
# SGLang model classes that build `DualChunkRotaryEmbedding` (rope_scaling ignored) for a checkpoint with Qwen's
# dual_chunk_attention_config; the plugin's plain RoPE stands in for it with the checkpoint's base frequencies
DUAL_CHUNK_ROPE_ARCHITECTURES = ("Qwen2ForCausalLM",)


class Setup(NamedTuple):
    config: MobaConfig
    dense: frozenset[int]  # layer indices of full attention
    where: str  # the config's source, for messages
    dca: ServedDca | None = None  # Dual Chunk Attention, None when off


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
    if set(architectures) & set(DUAL_CHUNK_ROPE_ARCHITECTURES) and rope_remap.qwen_dca_block(hf_config) is not None:
        rope = rope_type(hf_config)
        if rope != "default":  # SGLang's get_rope drops rope_scaling for a dual_chunk_attention_config
            raise MobaSetupError(
                f"moba_hf: SGLang's {', '.join(architectures)} rotates a checkpoint with a "
                f"dual_chunk_attention_config without its rope_scaling, but this one's rope type is {rope!r}: "
                "the transformers path would rotate differently. Serve a checkpoint without that block or "
                f"without the scaling (MoBA config from {where})"
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
    # SGLang rotates q and k from a table of max_position_embeddings rows; a later position fails mid-request
    table = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(table, int) and model_config.context_len > table:
        raise MobaSetupError(
            f"moba_hf: context_len={model_config.context_len} needs RoPE positions up to "
            f"{model_config.context_len - 1}, but SGLang's RoPE table covers max_position_embeddings={table}; lower "
            f"--context-length to {table}, or pass {OVERRIDE_FLAG} "
            f"'{{\"max_position_embeddings\": {model_config.context_len}}}'"
            + (" (DCA keeps every distance below its pretraining_length)" if dca_on(config, hf_config) else "")
        )
    try:
        return config.full_layer_set(hf_config.num_hidden_layers)
    except ValueError as err:
        raise MobaSetupError(f"moba_hf: bad MoBA config from {where}: {err}") from None


def dca_setup(model_config: Any, config: MobaConfig, where: str) -> ServedDca | None:
    """DCA's parameters against the model (`serving.dca_resolve`), or None when off; refuses what the SGLang
    plugin cannot serve exactly."""
    dca = dca_resolve(config, model_config.hf_text_config, where, "SGLang", DCA_ROPE_TYPES)
    overrides = getattr(model_config, "model_override_args", None) or {}
    if dca is not None and overrides.get("max_position_embeddings") == dca.params.pretraining_length:
        raise MobaSetupError(
            f"moba_hf: DCA's pretraining_length (from {where}) follows max_position_embeddings, which "
            f"{OVERRIDE_FLAG} raises to {dca.params.pretraining_length}; set pretraining_length (c, the longest "
            "distance the model handles) in the DCA config"
        )
    return dca


def setup(model_config: Any, cache_dtype: torch.dtype) -> Setup | None:
    """The server's MoBA config, checked (refusals raise `MobaSetupError`), or None without one; logs it."""
    found = resolve(model_config)
    if found is None:
        return None
    config, serving, where = found
    dense = check(model_config, config, serving, where, cache_dtype)
    dca = dca_setup(model_config, config, where)
    line = f"moba_hf: SGLang attention runs {config} from {where}; dense layers {sorted(dense) or 'none'}"
    logger.warning(line if dca is None else f"{line}; {dca_describe(dca)}")
    return Setup(config, dense, where, dca)


__all__ = [
    "ARCHITECTURES", "DCA_ROPE_TYPES", "DUAL_CHUNK_ROPE_ARCHITECTURES", "ENV", "OVERRIDE_FLAG", "MobaSetupError",
    "Setup", "check", "dca_setup", "resolve", "setup",
]  # fmt: skip
