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

from .. import serving
from ..config import MobaConfig
from ..serving import ENV, MobaSetupError

logger = logging.getLogger("moba_hf")

OVERRIDE_FLAG = "--json-model-override-args"


class Setup(NamedTuple):
    config: MobaConfig
    dense: frozenset[int]  # layer indices of full attention
    where: str  # the config's source, for messages


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
    serving.check_model("SGLang", list(getattr(model_config.hf_config, "architectures", None) or []), hf_config, where)
    if serving.dca_on(config, hf_config):
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
    serving.check_serving_options(
        options,
        where,
        server="SGLang",
        cache_dtype=str(model_dtype).removeprefix("torch."),
        cache_note="the model's dtype",
        context=("context_len", model_config.context_len, "--context-length"),
    )
    return serving.dense_layers(config, hf_config, where)


def setup(model_config: Any, cache_dtype: torch.dtype) -> Setup | None:
    """The server's MoBA config, checked (refusals raise `MobaSetupError`), or None without one; logs it."""
    found = resolve(model_config)
    if found is None:
        return None
    config, options, where = found
    dense = check(model_config, config, options, where, cache_dtype)
    logger.warning(f"moba_hf: SGLang attention runs {config} from {where}; dense layers {sorted(dense) or 'none'}")
    return Setup(config, dense, where)


__all__ = ["ENV", "OVERRIDE_FLAG", "MobaSetupError", "Setup", "check", "resolve", "setup"]
