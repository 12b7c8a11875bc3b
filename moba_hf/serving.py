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
"""

from __future__ import annotations

import logging
import os
from typing import Any

from . import logs
from .config import MobaConfig, read_config_file
from .integration import rope_remap

ENV = "MOBA_HF_CONFIG"
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


def dca_on(config: MobaConfig, text_config: Any) -> bool:
    """DCA from the MoBA config, or (none there) from the checkpoint's dual_chunk_attention_config."""
    return config.dca is not False and (config.dca is not None or rope_remap.qwen_dca_block(text_config) is not None)


__all__ = ["ENV", "QWEN_DCA_SOURCE", "MobaSetupError", "dca_on", "find_source", "read_source"]
