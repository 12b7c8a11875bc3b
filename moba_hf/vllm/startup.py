"""Which MobaConfig a vLLM engine runs, and the refusals that keep a bad setup from starting.

One schema, three places, the first found wins:
  1. ``--hf-overrides '{"moba_config": {...}}'`` (or a preset name / file path as the value),
  2. ``MOBA_HF_CONFIG=<preset name or .toml/.json/.yaml file>`` in the environment,
  3. ``moba_config`` in the checkpoint's config.json (what ``save_pretrained`` writes).
``--hf-overrides '{"moba_config": null}'`` turns MoBA off whatever the other two say.
None of them but Qwen's ``dual_chunk_attention_config`` in config.json (Qwen2.5-1M): dense DCA with its
settings, ``MobaConfig(sparse=False)``. None at all: the plugin stays out of the way and vLLM's own attention
runs.

Every check runs when the engine builds its attention layers, before any request is accepted.
"""

from __future__ import annotations

import logging
from typing import Any

from ..config import MobaConfig
from ..integration import rope_remap
from ..integration.support import check_supported, rope_type
from ..options import KV_CACHE_DTYPES, kv_cache_dtype
from ..serving import ENV, QWEN_DCA_SOURCE, MobaSetupError, dca_on, find_source, read_source
from .paged import PagedDca

logger = logging.getLogger("moba_hf")

# vLLM model classes the plugin runs: their attention layers hand the backend post-RoPE q / k of plain causal
# self-attention (the end-to-end tests run LlamaForCausalLM)
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# KV cache dtypes whose pages the MoBA kernels read as they are: the model's dtype ("auto" = the model's dtype)
READABLE_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32")
# DCA moves keys vLLM rotated with transformers' frequencies of the same rope type: the types where both
# libraries compute the same frequencies (vLLM folds YaRN's factor into its cos / sin cache, its own way)
DCA_ROPE_TYPES = ("default", "llama3")


def resolve(vllm_config: Any) -> tuple[MobaConfig, dict[str, Any], str] | None:
    """(config, serving options, where it came from), or None when no MoBA config is given anywhere (the
    sources and their order: `serving.find_source`)."""
    model_config = vllm_config.model_config
    overrides = model_config.hf_overrides if isinstance(model_config.hf_overrides, dict) else {}
    found = find_source(overrides, "--hf-overrides", model_config.hf_config, model_config.hf_text_config)
    if found is None:
        return None
    raw, where = found
    config, serving = read_source(raw, where)
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
    cache_dtype = vllm_config.cache_config.cache_dtype
    model_dtype = str(model_config.dtype).removeprefix("torch.")
    cache_runs = model_dtype if cache_dtype == "auto" else KV_CACHE_DTYPES.get(cache_dtype, cache_dtype)
    if cache_dtype not in READABLE_CACHE_DTYPES or cache_runs != model_dtype:
        raise MobaSetupError(
            f"moba_hf: kv_cache_dtype={cache_dtype!r} is not readable by the MoBA kernels with a {model_dtype} "
            "model; use --kv-cache-dtype auto (the model's dtype)"
        )
    if serving.get("kv_cache_dtype") is not None:
        try:  # the file's spelling (fp16, half, bf16 ...) as vLLM names it
            wanted = kv_cache_dtype(serving["kv_cache_dtype"])
        except ValueError as err:
            raise MobaSetupError(f"moba_hf: {where}: {err}") from None
        if wanted not in ("auto", model_dtype):
            spelled = serving["kv_cache_dtype"]
            asked = repr(wanted) if spelled == wanted else f"{spelled!r} ({wanted})"
            raise MobaSetupError(
                f"moba_hf: {where} asks for kv_cache_dtype={asked} but vLLM's KV "
                f"cache is {model_dtype} (--kv-cache-dtype {cache_dtype} with a {model_dtype} model), and the MoBA "
                f"kernels read a cache in the model's dtype: start vLLM with --dtype {wanted} (the cache follows it "
                "with --kv-cache-dtype auto, the default), or drop kv_cache_dtype from the file"
            )
    limit = serving.get("max_context_tokens")
    if limit is not None and model_config.max_model_len > int(limit):
        raise MobaSetupError(
            f"moba_hf: {where} allows max_context_tokens={limit} but vLLM runs max_model_len="
            f"{model_config.max_model_len}; pass --max-model-len {limit}"
        )
    # vLLM rotates q and k from a table of max_position_embeddings rows and reads past it for later positions
    # (garbage, NaN included, which the kernels' exact NaN route then follows); DCA has its own check, with advice
    table = getattr(hf_config, "max_position_embeddings", None)
    if not dca_on(config, hf_config) and isinstance(table, int) and model_config.max_model_len > table:
        raise MobaSetupError(
            f"moba_hf: max_model_len={model_config.max_model_len} needs RoPE positions up to "
            f"{model_config.max_model_len - 1}, but vLLM's RoPE table covers max_position_embeddings={table}; "
            f"lower --max-model-len to {table}, or pass --hf-overrides "
            f"'{{\"max_position_embeddings\": {model_config.max_model_len}}}' to run past the trained window"
        )
    try:
        return config.full_layer_set(hf_config.num_hidden_layers)
    except ValueError as err:
        raise MobaSetupError(f"moba_hf: bad MoBA config from {where}: {err}") from None


def dca_setup(vllm_config: Any, config: MobaConfig, where: str) -> PagedDca | None:
    """DCA's parameters against the model (as the transformers path resolves them), or None when off;
    refuses what the paged DCA cannot serve exactly."""
    model_config = vllm_config.model_config
    hf_config = model_config.hf_text_config
    if not dca_on(config, hf_config):
        return None
    rope = rope_type(hf_config)
    if rope not in DCA_ROPE_TYPES:
        raise MobaSetupError(
            f"moba_hf: DCA (from {where}) in vLLM supports the rope types {', '.join(DCA_ROPE_TYPES)}; this model's "
            f"is {rope!r}. Serve it without DCA (dca = false) or use the transformers path"
        )
    try:
        resolved = rope_remap.resolve(config.dca, hf_config, config.block_size if config.sparse else None)
    except ValueError as err:
        raise MobaSetupError(f"moba_hf: DCA (from {where}): {err}") from None
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
    return PagedDca(resolved, rope_remap.config_inv_freq(hf_config))


def describe(config: MobaConfig, dense: frozenset[int], where: str, dca: PagedDca | None = None) -> str:
    text = f"moba_hf: vLLM attention runs {config} from {where}; dense layers {sorted(dense) or 'none'}"
    if dca is not None:
        p = dca.params
        text += (
            f"; Dual Chunk Attention: pretraining_length c={p.pretraining_length}, chunk_size s={p.chunk_size}, "
            f"temperature {'on' if p.temperature else 'off'}"
        )
    return text


__all__ = [
    "ARCHITECTURES", "ENV", "QWEN_DCA_SOURCE", "MobaSetupError", "check", "dca_setup", "describe", "resolve",
]  # fmt: skip
