"""Which models "moba" can run, decided from what the model's code does rather than from a list of names.

transformers hands post-RoPE q / k to the function registered under `config._attn_implementation` for
every model whose attention modules dispatch through `ALL_ATTENTION_FUNCTIONS`. That function is exact for
the model when, in addition,

    every attention module is causal self-attention     (is_causal; no cross-attention, no bidirectional mode)
    every layer is full attention                       (layer_types / sliding_window)
    the model builds its mask with masking_utils        (so "moba"'s 2-D padding mask reaches the function)
    nothing else changes the scores                     (no softcap= / s_aux= handed to the function)
    the model uses RoPE                                 (moba_hf's scope: RoPE decoders)

Attention dropout is refused where it would act: by the attention function, in training.
DCA moves RoPE positions by rotating q and k again, so it also needs frequencies that do not depend on
the sequence length (`FIXED_ROPE_TYPES`) applied over the whole head in the rotate-half layout;
`check_dca_rope` checks that numerically against the model's own rotary code.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import json
import logging
import textwrap
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

from .. import logs
from ..kernels.rope import rotate

logger = logging.getLogger("moba_hf")

# The families tests/test_model_families.py, test_integration.py and test_dca_models.py run end to end
# (a test keeps this in step with them). Others that pass the checks run too, with a one-time note.
SUPPORTED_MODEL_TYPES = (
    "cohere",
    "gemma",
    "granite",
    "llama",
    "mistral",
    "mixtral",
    "olmo",
    "olmo2",
    "phi3",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "stablelm",
)

# keywords an attention module may hand the attention function: "moba" implements these (sliding_window only
# as None, which the config check makes sure of; position_ids locate packed sequences)
_KNOWN_KWARGS = frozenset({"dropout", "scaling", "sliding_window", "position_ids"})


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """A model family as its modeling code shows it (what "moba" needs to know), read once per config class."""

    module: ModuleType | None
    problems: tuple[str, ...]  # reasons the code itself rules "moba" out (empty: fine)
    uses_sliding_window: bool  # its code reads sliding_window (in the attention call or the mask)
    rotary: type | None  # the model's RoPE class (None: no RoPE)
    attentions: tuple[type, ...] = ()  # its attention module classes


def check_supported(model_config: Any) -> None:
    """Refuse (ValueError) a model "moba" cannot run exactly, naming every property that is missing."""
    model_type = getattr(model_config, "model_type", None)
    text = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    if text is not model_config:  # apply() would switch the vision / audio towers to "moba" too
        raise ValueError(
            f"moba_hf runs decoder-only language models; model_type={model_type!r} is a composite model "
            f"(text decoder {getattr(text, 'model_type', None)!r} plus other towers)"
        )
    family = family_of(type(model_config))
    if getattr(model_config, "is_heterogeneous", False):  # its global fields would not describe every layer
        problems = [*family.problems, "its layers have different configs (per_layer_config)"]
    else:
        problems = [*family.problems, *_config_problems(model_config, family)]
    if problems:
        raise ValueError(
            f"moba_hf cannot run model_type={model_type!r}: "
            + "; ".join(problems)
            + f". Families verified by tests: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        logs.once(
            logging.WARNING,
            "moba_hf: model_type=%r passes the support checks but no test runs it (verified: %s)",
            model_type,
            ", ".join(SUPPORTED_MODEL_TYPES),
        )


def _window_covers_context(model_config: Any) -> bool:
    """No sliding window, or one that never cuts a key inside the model's context (Phi-3-128K's 262144 over
    131072 positions); longer prompts are refused at run time."""
    window = getattr(model_config, "sliding_window", None)
    context = getattr(model_config, "max_position_embeddings", None)
    return window is None or (context is not None and window >= context)


def _config_problems(model_config: Any, family: ModelFamily) -> list[str]:
    problems = []
    layer_types = getattr(model_config, "layer_types", None)
    if layer_types:
        if any(t != "full_attention" for t in layer_types):
            problems.append(
                f"moba_hf needs every layer to be full attention before it sparsifies it; this config has "
                f"layer_types {sorted(set(layer_types))} (e.g. use_sliding_window=True is not supported)"
            )
    elif family.uses_sliding_window and not _window_covers_context(model_config):
        # without layer_types, config.sliding_window applies to every layer (in the mask, the call or both)
        problems.append(
            f"every layer attends within sliding_window={model_config.sliding_window}, which moba attention does "
            "not implement (sliding_window=None, or a window at least max_position_embeddings long, is supported)"
        )
    v_dim, qk_dim = getattr(model_config, "v_head_dim", None), _qk_head_dim(model_config)
    if v_dim is not None and qk_dim is not None and v_dim != qk_dim:
        problems.append(
            f"values have head dim {v_dim} and queries / keys {qk_dim} (latent attention); the kernels take one"
        )
    bidirectional = getattr(model_config, "use_bidirectional_attention", None)
    if bidirectional:
        problems.append(f"use_bidirectional_attention={bidirectional!r}: moba attention is causal")
    return problems


def _qk_head_dim(model_config: Any) -> int | None:
    nope, rope = getattr(model_config, "qk_nope_head_dim", None), getattr(model_config, "qk_rope_head_dim", None)
    if nope is not None and rope is not None:
        return nope + rope
    return getattr(model_config, "qk_head_dim", None)


@functools.cache
def family_of(config_class: type) -> ModelFamily:
    """Read the modeling code that belongs to `config_class` (…configuration_x -> …modeling_x)."""
    name = config_class.__module__
    if ".configuration_" not in name:
        problem = f"no modeling code found for config class {config_class.__name__}"
        return ModelFamily(None, (problem,), False, None)
    try:
        module = importlib.import_module(name.replace(".configuration_", ".modeling_"))
    except ImportError as error:
        return ModelFamily(None, (f"its modeling code does not import ({error})",), False, None)
    attentions = [
        cls
        for key, cls in vars(module).items()
        if key.endswith("Attention")
        and inspect.isclass(cls)
        and issubclass(cls, torch.nn.Module)
        and cls.__module__ == module.__name__
    ]
    problems = [] if attentions else [f"{module.__name__} defines no *Attention module"]
    for cls in attentions:
        problems += _attention_problems(cls)
    source = _source(module)
    if "create_causal_mask" not in source:
        problems.append("the model builds its attention mask itself, not with transformers' masking_utils")
    extra = sorted(f for f in ("or_mask_function", "and_mask_function") if f in source)
    if extra:  # e.g. bidirectional image tokens: "moba"'s mask is the padding mask only
        problems.append(f"the model adds to the causal mask ({', '.join(extra)}), which moba attention does not apply")
    rotary = _rotary_class(module, attentions)
    if rotary is None:
        problems.append("it has no RoPE (moba_hf covers RoPE decoders)")
    return ModelFamily(module, tuple(problems), "sliding_window" in source, rotary, tuple(attentions))


def _source(obj: Any) -> str:
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return ""


def _attention_problems(cls: type) -> list[str]:
    source = _source(cls)
    name = cls.__name__
    if "ALL_ATTENTION_FUNCTIONS" not in source or "_attn_implementation" not in source:
        return [f"{name} does not dispatch through transformers' ALL_ATTENTION_FUNCTIONS"]
    tree = ast.parse(source)
    dispatchers = {"attention_interface"}  # the variable ALL_ATTENTION_FUNCTIONS.get_interface(...) is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and "ALL_ATTENTION_FUNCTIONS" in ast.unparse(node.value):
            dispatchers |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    keywords, causal = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in dispatchers:
            keywords |= {k.arg for k in node.keywords if k.arg is not None}
        if isinstance(node, ast.Assign) and any(ast.unparse(t) == "self.is_causal" for t in node.targets):
            causal.append(ast.unparse(node.value))
    problems = [
        f"{name} hands {key}= to the attention function, which moba attention does not implement"
        for key in sorted(keywords - _KNOWN_KWARGS)
    ]
    # True, or Gemma's `not use_bidirectional_attention` (the config check refuses that flag)
    if not causal or any(c != "True" and "use_bidirectional_attention" not in c for c in causal):
        problems.append(f"{name} is not always causal self-attention (is_causal = {' / '.join(causal) or 'unset'})")
    return problems


def _rotary_class(module: ModuleType, attentions: list[type]) -> type | None:
    rotaries = {k: cls for k, cls in vars(module).items() if k.endswith("RotaryEmbedding") and inspect.isclass(cls)}
    for cls in attentions:  # the naming integration.rope_remap uses to find a layer's frequencies
        match = rotaries.get(cls.__name__.removesuffix("Attention") + "RotaryEmbedding")
        if match is not None:
            return match
    return next(iter(rotaries.values())) if len(rotaries) == 1 else None


# rope types whose frequencies do not depend on the sequence length, so rotating by a position delta is exact
# (YaRN's attention factor scales cos / sin by a constant, which the extra rotation keeps); dynamic NTK and
# longrope switch frequencies with the sequence length
FIXED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(model_config: Any) -> dict[str, Any]:
    params = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
    return dict(params) if isinstance(params, Mapping) else {}


def rope_type(model_config: Any) -> str:
    """The config's RoPE scaling type ("default" when it has none)."""
    params = rope_parameters(model_config)
    return params.get("rope_type", params.get("type", "default")) or "default"


def check_rope_type(model_config: Any) -> None:
    """Refuse RoPE scalings whose frequencies change with the sequence length (DCA needs fixed ones)."""
    kind = rope_type(model_config)
    if kind not in FIXED_ROPE_TYPES:
        raise ValueError(
            f"DCA needs RoPE frequencies that do not depend on the sequence length; this model's rope_scaling type "
            f"is {kind!r} (supported: {', '.join(FIXED_ROPE_TYPES)}). Remove the {kind!r} scaling from "
            "the model config to use DCA."
        )


def check_dca_rope(model_config: Any) -> None:
    """Refuse (ValueError) DCA for a model whose RoPE DCA cannot move exactly: a rope type whose frequencies
    depend on the sequence length, RoPE over part of the head, or another pairing of dimensions."""
    check_rope_type(model_config)
    problem = _rope_layout_problem(type(model_config), _rope_key(model_config), model_config)
    if problem is not None:
        raise ValueError(
            f"DCA moves RoPE positions by rotating q and k with the model's frequencies over the whole head, "
            f"pairing dim d with d + head_dim/2; model_type={getattr(model_config, 'model_type', None)!r}: "
            f"{problem}. Use MoBA without DCA (dca=False)."
        )


def _rope_key(model_config: Any) -> str:
    params = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
    fields = ("head_dim", "hidden_size", "num_attention_heads", "partial_rotary_factor", "rotary_pct")
    params = dict(params) if isinstance(params, Mapping) else str(params)
    return json.dumps([params, [getattr(model_config, f, None) for f in fields]], sort_keys=True, default=str)


_LAYOUTS: dict[tuple[type, str], str | None] = {}


def _rope_layout_problem(config_class: type, key: str, model_config: Any) -> str | None:
    """Rotate a test vector with the model's own RoPE code and with `kernels.rope.rotate`; cached per RoPE setting
    (this runs in every forward, once per layer)."""
    cached = _LAYOUTS.get((config_class, key), ...)
    if cached is not ...:
        return cached
    family = family_of(config_class)
    apply_rope = getattr(family.module, "apply_rotary_pos_emb", None)
    if family.rotary is None or apply_rope is None:
        problem = "no RoPE class / apply_rotary_pos_emb found in its modeling code"
    else:
        try:
            rope = family.rotary(config=model_config)
            inv_freq = rope.inv_freq.float()
            head_dim = getattr(model_config, "head_dim", None) or (
                model_config.hidden_size // model_config.num_attention_heads
            )
            if 2 * inv_freq.numel() != head_dim:
                problem = f"RoPE covers {2 * inv_freq.numel()} of {head_dim} head dims (partial rotary)"
            else:
                x = torch.randn(1, 1, 3, head_dim, generator=torch.Generator().manual_seed(0))
                positions = torch.tensor([[0, 5, 11]])
                cos, sin = rope(x, positions)
                got = apply_rope(x, x, cos, sin)[0]
                want = rotate(x, positions[0], inv_freq) * getattr(rope, "attention_scaling", 1.0)
                close = torch.allclose(got, want, rtol=0, atol=1e-4)
                problem = None if close else "its RoPE pairs dimensions differently (e.g. interleaved)"
        except Exception as error:  # noqa: BLE001 - any failure means the layout could not be confirmed
            problem = f"could not check its RoPE layout ({type(error).__name__}: {error})"
    _LAYOUTS[(config_class, key)] = problem
    return problem
