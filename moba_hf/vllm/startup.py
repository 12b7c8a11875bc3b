"""Which MobaConfig a vLLM engine runs, and the refusals that keep a bad setup from starting.

The sources and their order are every server plugin's (`serving.find_source`): ``--hf-overrides
'{"moba_config": {...}}'`` (a null value turns MoBA off), then ``MOBA_HF_CONFIG``, then the checkpoint's
config.json; Qwen's ``dual_chunk_attention_config`` alone gives dense DCA. None at all: the plugin stays out of
the way and vLLM's own attention runs.

`setup` is the one reader of the engine config: every class of the plugin (the metadata builders, the attention
impls, the dense GPU backends' guards) asks it, and every check runs when the engine builds its attention
layers, before any request is accepted.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from .. import core, logs, serving
from ..config import MobaConfig
from ..options import KV_CACHE_DTYPES
from ..serving import ENV, QWEN_DCA_SOURCE, MobaSetupError, ServedDca

logger = logging.getLogger("moba_hf")

# KV cache dtypes whose pages the MoBA kernels read as they are: the model's dtype ("auto" = the model's dtype)
READABLE_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32")
# DCA moves keys vLLM rotated with transformers' frequencies of the same rope type: the types where both
# libraries compute the same frequencies (vLLM folds YaRN's factor into its cos / sin cache, its own way)
DCA_ROPE_TYPES = ("default", "llama3")


class Setup(NamedTuple):
    config: MobaConfig  # what the startup checks and the log line read
    plan: core.AttentionPlan  # what the attention path reads: which keys each query sees, every layer
    dca: ServedDca | None  # DCA's parameters (`plan.dca`) with the model's RoPE frequencies; None when off
    where: str  # the config's source, for messages


def setup(vllm_config: Any) -> Setup | None:
    """The engine's MoBA config, checked (refusals raise `MobaSetupError`), or None without one; the first call
    per config logs it."""
    found = resolve(vllm_config)
    if found is None:
        return None
    config, options, where = found
    dense = check(vllm_config, config, options, where)
    dca = dca_setup(vllm_config, config, where)
    logs.once(logging.WARNING, describe(config, dense, where, dca))
    plan = serving.attention_plan(config, vllm_config.model_config.hf_text_config, where, dca)
    return Setup(config, plan, dca, where)


def resolve(vllm_config: Any) -> tuple[MobaConfig, dict[str, Any], str] | None:
    """(config, serving options, where it came from), or None when no MoBA config is given anywhere (the
    sources and their order: `serving.find_source`)."""
    model_config = vllm_config.model_config
    overrides = model_config.hf_overrides if isinstance(model_config.hf_overrides, dict) else {}
    return serving.find_config(overrides, "--hf-overrides", model_config.hf_config, model_config.hf_text_config)


def check(vllm_config: Any, config: MobaConfig, options: dict[str, Any], where: str) -> frozenset[int]:
    """Refuse what the plugin cannot serve exactly; return the dense (full-attention) layer indices."""
    model_config = vllm_config.model_config
    hf_config = model_config.hf_text_config
    serving.check_model("vLLM", list(getattr(model_config, "architectures", None) or []), hf_config, where)
    window = model_config.get_sliding_window()
    if window is not None:
        raise MobaSetupError(
            f"moba_hf: sliding-window attention (window {window}) cannot be combined with MoBA; "
            "serve a checkpoint whose layers are all full attention"
        )
    cache_dtype = vllm_config.cache_config.cache_dtype
    model_dtype = str(model_config.dtype).removeprefix("torch.")
    cache_runs = model_dtype if cache_dtype == "auto" else KV_CACHE_DTYPES.get(cache_dtype, cache_dtype)
    if cache_dtype not in READABLE_CACHE_DTYPES or cache_runs != model_dtype:
        raise MobaSetupError(
            f"moba_hf: kv_cache_dtype={cache_dtype!r} is not readable by the MoBA kernels with a {model_dtype} "
            "model; use --kv-cache-dtype auto (the model's dtype)"
        )
    serving.check_serving_options(
        options,
        where,
        server="vLLM",
        cache_dtype=model_dtype,
        cache_note=f"--kv-cache-dtype {cache_dtype} with a {model_dtype} model",
        context=("max_model_len", model_config.max_model_len, "--max-model-len"),
    )
    # vLLM rotates q and k from a table of max_position_embeddings rows and reads past it for later positions
    # (garbage, NaN included, which the kernels' exact NaN route then follows); DCA has its own check, with advice
    table = getattr(hf_config, "max_position_embeddings", None)
    if not serving.dca_on(config, hf_config) and isinstance(table, int) and model_config.max_model_len > table:
        raise MobaSetupError(
            f"moba_hf: max_model_len={model_config.max_model_len} needs RoPE positions up to "
            f"{model_config.max_model_len - 1}, but vLLM's RoPE table covers max_position_embeddings={table}; "
            f"lower --max-model-len to {table}, or pass --hf-overrides "
            f"'{{\"max_position_embeddings\": {model_config.max_model_len}}}' to run past the trained window"
        )
    return serving.dense_layers(config, hf_config, where)


def dca_setup(vllm_config: Any, config: MobaConfig, where: str) -> ServedDca | None:
    """DCA's parameters against the model (as the transformers path resolves them), or None when off;
    refuses what the paged DCA cannot serve exactly."""
    model_config = vllm_config.model_config
    hf_config = model_config.hf_text_config
    dca = serving.dca_resolve(config, hf_config, where, "vLLM", DCA_ROPE_TYPES)
    if dca is None:
        return None
    resolved = dca.params
    # vLLM rotates q and k at their absolute positions from a table of max_position_embeddings rows before
    # the backend moves them; past that table the rotation has no data
    table = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(table, int) and model_config.max_model_len > table:
        raise MobaSetupError(
            f"moba_hf: max_model_len={model_config.max_model_len} needs RoPE positions up to "
            f"{model_config.max_model_len - 1}, but vLLM's RoPE table covers max_position_embeddings={table}; pass "
            f"--hf-overrides '{{\"max_position_embeddings\": {model_config.max_model_len}}}' (DCA keeps every "
            f"distance below pretraining_length={resolved.pretraining_length}: set it in the DCA config, since "
            f"by default it follows max_position_embeddings) or lower --max-model-len to {table}"
        )
    overrides = model_config.hf_overrides if isinstance(model_config.hf_overrides, dict) else {}
    if overrides.get("max_position_embeddings") == resolved.pretraining_length:
        raise MobaSetupError(
            f"moba_hf: DCA's pretraining_length (from {where}) follows max_position_embeddings, which "
            f"--hf-overrides raises to {resolved.pretraining_length}; set pretraining_length (c, the longest "
            "distance the model handles) in the DCA config"
        )
    return dca


def describe(config: MobaConfig, dense: frozenset[int], where: str, dca: ServedDca | None = None) -> str:
    text = f"moba_hf: vLLM attention runs {config} from {where}; dense layers {sorted(dense) or 'none'}"
    return text if dca is None else f"{text}; {serving.dca_describe(dca)}"


__all__ = [
    "ENV",
    "QWEN_DCA_SOURCE",
    "MobaSetupError",
    "Setup",
    "check",
    "dca_setup",
    "describe",
    "resolve",
    "setup",
]
