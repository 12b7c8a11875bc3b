"""vLLM's FlashAttention and FlashInfer backends, refusing a MoBA config (NVIDIA GPUs).

vLLM's CUDA platform picks the first valid backend of its list (FLASH_ATTN, FLASHINFER, TRITON_ATTN, ... on
most GPUs; FLASHINFER first on SM100); the MoBA backend is the Triton one. On CUDA the plugin registers these
subclasses in place of FLASH_ATTN and FLASHINFER: with a MoBA config `validate_configuration` names it, so the
platform's choice falls through to TRITON_ATTN (the MoBA Triton backend), and an explicit
``--attention-backend FLASH_ATTN`` is refused with that reason. Without one they are vLLM's backends, unchanged.

Each class is built on first access (module ``__getattr__``), so looking one up imports only its own vLLM
backend (FlashInfer may be missing where FlashAttention is not).
"""

from __future__ import annotations

from typing import Any

BASES = {
    "FlashAttentionBackend": "vllm.v1.attention.backends.flash_attn",
    "FlashInferBackend": "vllm.v1.attention.backends.flashinfer",
}


def moba_reason() -> str | None:
    """Why a dense GPU backend must not serve this engine: a MoBA config is found; None without one."""
    from vllm.config import get_current_vllm_config

    from . import startup

    vllm_config = get_current_vllm_config()
    if vllm_config.model_config is None:  # a process that selects backends without a model (none to serve)
        return None
    found = startup.setup(vllm_config)
    if found is None:
        return None
    return (
        f"moba_hf: a MoBA config is set ({found.where}) and MoBA runs in the Triton backend: "
        "use --attention-backend TRITON_ATTN (or CUSTOM), or none"
    )


def guard(base: type) -> type:
    """`base` whose `validate_configuration` also refuses a MoBA config."""

    def validate_configuration(cls: type, *args: Any, **kwargs: Any) -> list[str]:
        reasons = super(guarded, cls).validate_configuration(*args, **kwargs)
        reason = moba_reason()
        return [*reasons, reason] if reason is not None else reasons

    guarded = type(base.__name__, (base,), {"validate_configuration": classmethod(validate_configuration)})
    guarded.__module__, guarded.__qualname__ = __name__, base.__name__
    guarded.__doc__ = f"vLLM's {base.__name__}, refusing a MoBA config (see moba_hf.vllm.guards)."
    return guarded


def __getattr__(name: str) -> type:
    if name not in BASES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    cls = guard(getattr(importlib.import_module(BASES[name]), name))
    globals()[name] = cls
    return cls
