"""The vocabulary of MoBA's settings that needs no torch: gate poolings, the built-in kernel backends, the
spellings of a KV cache dtype, and numbers and switches as config files write them. `moba_hf.config` validates
against these without importing the kernels, so reading a config file (and `moba-hf presets`) loads no torch;
`moba_hf.kernels` takes its poolings from here. Standard library only: every layer may import it.
"""

from __future__ import annotations

import numbers
import re
from typing import Any

POOLINGS = ("mean", "max", "mean+max", "bound")
# "auto" and the backends `moba_hf.kernels` registers at import; a name registered later (`register_backend`)
# is checked against the live registry
BUILTIN_BACKENDS = ("auto", "reference", "torch", "flex", "triton", "flash")

# KV cache dtype as people write it -> vLLM's name (`--kv-cache-dtype` takes auto, float16, bfloat16, fp8, ...;
# `--dtype` takes half and float too). "auto": the model's dtype. The MoBA kernels read float pages as they are.
KV_CACHE_DTYPES = {
    "auto": "auto",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
}


# The largest integer setting (block_size, top_k, sink_blocks, ...; DCA's lengths): 2**62 - 1. The kernels hold
# positions, block indices and these counts in int64 tensors and add a count to a position or to another count
# (`current - local_blocks`, DCA's `chunk_size + position % chunk_size`): two values below 2**62 sum below int64's
# 2**63 - 1, where 2**63 itself wraps to a negative number (a sink block silently dropped, NaN in decoding). Any
# value at or past the sequence's length acts as that length, so the bound takes nothing a model can use.
MAX_COUNT = 2**62 - 1


def check_count(name: str, value: object, low: int) -> None:
    """An integer in [low, MAX_COUNT] (a bool is not a count); ValueError naming `name`, the value and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {short(value)}")
    if value > MAX_COUNT:
        raise ValueError(
            f"{name} must be at most {MAX_COUNT} (2**62 - 1, the largest count the kernels' int64 arithmetic "
            f"holds; a value past the sequence's length acts as that length), got {short(value)}"
        )


def plain_number(value: Any) -> Any:
    """A numpy scalar (or any other `numbers` integer / real that is not Python's own) as the Python int / float it
    equals, so configs compare, hash and serialize (JSON) as Python numbers; anything else unchanged."""
    if isinstance(value, (bool, int, float)) and type(value) in (bool, int, float):
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def short(value: object) -> str:
    """`repr(value)`, cut to 60 characters for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_top_p(value: object) -> None:
    """`top_p` is None (a fixed top_k budget) or a real number in (0, 1] (NaN fails the comparison; a bool is not
    a share)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1):
        raise ValueError(f"top_p must be None (a fixed top_k budget) or a number in (0, 1], got {value!r}")


def check_budget_options(top_p: object, min_top_k: object) -> None:
    """min_top_k only bounds an adaptive budget: one given without top_p would change nothing, so it is refused."""
    if top_p is None and min_top_k != 1:
        raise ValueError(
            f"min_top_k applies only with top_p (an adaptive budget); got min_top_k={min_top_k!r} and top_p=None"
        )


def kv_cache_dtype(value: object, name: str = "kv_cache_dtype") -> str:
    """`value` as vLLM names the dtype ("fp16" -> "float16"); ValueError naming the spellings otherwise."""
    canonical = KV_CACHE_DTYPES.get(value.strip().lower()) if isinstance(value, str) else None
    if canonical is None:
        spellings = {}
        for spelling, target in KV_CACHE_DTYPES.items():
            spellings.setdefault(target, []).append(spelling)
        accepted = "; ".join(" / ".join(group) for group in spellings.values())
        raise ValueError(
            f"{name} must be a KV cache dtype the MoBA kernels read ({accepted}), got {value!r}"
            + (" (quantized caches are not readable by the MoBA kernels)" if _quantized(value) else "")
        )
    return canonical


def _quantized(value: object) -> bool:
    return isinstance(value, str) and value.strip().lower().startswith(("fp8", "int", "nvfp4", "turbo", "ultra"))


# --- values as config files give them ---------------------------------------------------------------------
# Server files pasted from a guide often carry numbers in quotes ("2", "4096"): digits alone are one integer, so
# they are read as it; anything else ("2.0", "4K", "two") is left for the field's check to refuse.
_DIGITS = re.compile(r"[+-]?[0-9]+")


def file_int(value: Any) -> Any:
    """`value`, with a string of digits ("2", " 4096 ") read as the integer it spells."""
    if isinstance(value, str) and _DIGITS.fullmatch(value.strip()):
        return int(value.strip())
    return value


def file_bool(name: str, value: Any) -> bool:
    """true / false, or the strings "true" / "false" in any case; nothing else (not 0 / 1, "yes", "on")."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f'{name} must be true or false (or the string "true" / "false"), got {value!r}')
