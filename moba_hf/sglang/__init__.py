"""MoBA in SGLang: a `sglang.srt.plugins` entry point that registers the attention backend `moba`.

    pip install moba-hf                 # beside your SGLang; SGLang finds the plugin through its entry point
    MOBA_HF_CONFIG=training-free python -m sglang.launch_server --model-path PATH --device cpu \\
        --attention-backend moba --dtype float32 --disable-cuda-graph
    python -m sglang.launch_server ... --json-model-override-args '{"moba_config": {"block_size": 512, "top_k": 3}}'

SGLang calls `register` in every process it starts (the launcher before it parses the server arguments, the
scheduler, detokenizer and data-parallel workers); it may run more than once. It adds:

    ATTENTION_BACKENDS["moba"]          the factory: on CPU `backend.MobaTorchNativeBackend` (SGLang's
                                        torch-native backend plus MoBA), on NVIDIA GPUs
                                        `gpu_backend.MobaTritonBackend` (its Triton backend plus MoBA, the
                                        pool's layout checked at startup); other platforms are refused, named,
                                        and so are --enable-torch-compile and, with a MoBA config on a GPU,
                                        CUDA graphs (pass --disable-cuda-graph); CUDA graphs are never
                                        captured on CPU
    --attention-backend choices         "moba"
    mem_cache.allocation.get_last_loc   SGLang runs a Triton kernel here unless the backend is named
                                        torch_native: for CPU tensors the plugin runs SGLang's own torch version
    DualChunkRotaryEmbedding            what SGLang's Qwen2 builds for a dual_chunk_attention_config: with the
                                        `moba` backend plain RoPE (`rope`), the backend runs DCA itself

With no MoBA config anywhere (see `startup`) the backend is SGLang's torch-native (CPU) or Triton (GPU) backend,
unchanged.
"""

from __future__ import annotations

from typing import Any

NAME = "moba"
LAST_LOC = "sglang.srt.mem_cache.allocation.get_last_loc"
_registered: list[bool] = []


def platform(model_runner: Any) -> str:
    """'cpu', 'cuda' (NVIDIA) or the device SGLang's model runner names: what `create_backend` serves."""
    import torch

    kind = str(model_runner.device).split(":")[0]
    if kind == "cuda" and torch.version.hip is not None:
        return "rocm"
    return kind


def create_backend(model_runner: Any) -> Any:
    """The attention backend of `--attention-backend moba` for SGLang's model runner (startup checks first)."""
    from . import startup

    here = platform(model_runner)
    if here not in ("cpu", "cuda"):
        raise startup.MobaSetupError(
            f"moba_hf: SGLang's attention backend {NAME!r} runs on CPU (--device cpu, over SGLang's torch-native "
            f"backend) and NVIDIA GPUs (over SGLang's Triton backend); this server runs on {here!r} "
            f"({model_runner.device})"
        )
    if getattr(model_runner.server_args, "enable_torch_compile", False):
        # SGLang captures a graph of the forward with torch.compile; the backend reads host lists every step
        raise startup.MobaSetupError(
            f"moba_hf: SGLang's attention backend {NAME!r} runs eagerly; drop --enable-torch-compile (it captures "
            "a graph of the forward)"
        )
    found = startup.setup(model_runner.model_config, model_runner.kv_cache_dtype)
    if here == "cpu":
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        from .backend import MobaTorchNativeBackend

        return TorchNativeAttnBackend(model_runner) if found is None else MobaTorchNativeBackend(model_runner, found)
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    if found is None:
        return TritonAttnBackend(model_runner)
    from sglang.srt.model_executor.cuda_graph_config import cuda_graph_fully_disabled

    if not cuda_graph_fully_disabled():  # a captured graph would replay one batch's host-side loop
        raise startup.MobaSetupError(
            f"moba_hf: SGLang's attention backend {NAME!r} with a MoBA config runs eagerly (it loops over the "
            "batch's sequences on the host); start SGLang with --disable-cuda-graph"
        )
    from .gpu_backend import MobaTritonBackend

    return MobaTritonBackend(model_runner, found)


def last_loc(original: Any, req_to_token: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's `get_last_loc`, with its torch version for CPU tensors (its Triton kernel needs a GPU)."""
    if req_to_token.device.type == "cpu":
        from sglang.srt.mem_cache.allocation import get_last_loc_torch

        return get_last_loc_torch(req_to_token, *args, **kwargs)
    return original(req_to_token, *args, **kwargs)


def register() -> None:
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    register_attention_backend(NAME)(create_backend)
    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    if not _registered:  # SGLang applies a hook once per process; register it once
        from . import rope

        _registered.append(True)
        HookRegistry.register(LAST_LOC, last_loc, HookType.AROUND)
        HookRegistry.register(rope.TARGET, rope.PlainRotaryEmbedding, HookType.REPLACE)


__all__ = ["LAST_LOC", "NAME", "create_backend", "last_loc", "platform", "register"]
