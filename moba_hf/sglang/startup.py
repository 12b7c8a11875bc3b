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

from .. import core, serving
from ..config import MobaConfig
from ..integration import rope_remap
from ..integration.support import rope_type
from ..serving import ENV, MobaSetupError, ServedDca, dca_describe, dca_on, dca_resolve

logger = logging.getLogger("moba_hf")

OVERRIDE_FLAG = "--json-model-override-args"
# DCA moves keys SGLang rotated with transformers' frequencies of the same rope type: the types where both
# libraries compute the same frequencies
DCA_ROPE_TYPES = ("default", "llama3")
# SGLang model classes that build `DualChunkRotaryEmbedding` (rope_scaling ignored) for a checkpoint with Qwen's
# dual_chunk_attention_config; the plugin's plain RoPE stands in for it with the checkpoint's base frequencies
DUAL_CHUNK_ROPE_ARCHITECTURES = ("Qwen2ForCausalLM",)


class Setup(NamedTuple):
    config: MobaConfig  # what the startup checks and the log line read
    plan: core.AttentionPlan  # what the attention path reads: which keys each query sees, every layer
    where: str  # the config's source, for messages
    dca: ServedDca | None = None  # DCA's parameters (`plan.dca`) with the model's RoPE frequencies; None when off


def resolve(model_config: Any) -> tuple[MobaConfig, dict[str, Any], str] | None:
    """(config, serving options, where it came from) from an SGLang `ModelConfig`, or None without one."""
    overrides = getattr(model_config, "model_override_args", None) or {}
    return serving.find_config(overrides, OVERRIDE_FLAG, model_config.hf_config, model_config.hf_text_config)


def check(
    model_config: Any, config: MobaConfig, options: dict[str, Any], where: str, cache_dtype: torch.dtype
) -> frozenset[int]:
    """Refuse what the plugin cannot serve exactly; return the dense (full-attention) layer indices.
    cache_dtype: the dtype of SGLang's KV pool."""
    hf_config = model_config.hf_text_config
    architectures = list(getattr(model_config.hf_config, "architectures", None) or [])
    serving.check_model("SGLang", architectures, hf_config, where)
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
    serving.check_serving_options(
        options,
        where,
        server="SGLang",
        cache_dtype=str(model_dtype).removeprefix("torch."),
        cache_note="the model's dtype",
        context=("context_len", model_config.context_len, "--context-length"),
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
    return serving.dense_layers(config, hf_config, where)


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
    config, options, where = found
    dense = check(model_config, config, options, where, cache_dtype)
    dca = dca_setup(model_config, config, where)
    line = f"moba_hf: SGLang attention runs {config} from {where}; dense layers {sorted(dense) or 'none'}"
    logger.warning(line if dca is None else f"{line}; {dca_describe(dca)}")
    return Setup(config, serving.attention_plan(config, model_config.hf_text_config, where, dca), where, dca)


__all__ = [
    "DCA_ROPE_TYPES",
    "DUAL_CHUNK_ROPE_ARCHITECTURES",
    "ENV",
    "OVERRIDE_FLAG",
    "MobaSetupError",
    "Setup",
    "check",
    "dca_setup",
    "resolve",
    "setup",
]
