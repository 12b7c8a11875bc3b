"""`DcaConfig`: Dual Chunk Attention's configuration and its validation (resolved against a model config in
`integration.rope_remap`).

Paper convention (An et al., ICML 2024): pretraining length ``c``, chunk size ``s < c``, local window
``w = c - s``. Keys sit at ``j mod s``; a query at ``i`` sits at ``i mod s`` for keys of its own chunk,
``min(s + i mod s, c - 1)`` for the previous chunk and ``c - 1`` for older chunks, so no distance exceeds
``c - 1``.

Default chunk size: ``s = c - c // 8`` (local window w = c/8; 7168 for c = 8192). Established practice
keeps the window a small fraction of c: ChunkLlama uses c/16 (and caps distances at 3c/4), Qwen2.5-1M c/32.
We take c/8: the window decides how many tokens after a chunk start still see exact distances into the
previous chunk, and a wider one smooths the boundary for slightly more (shorter) chunks. s = 7c/8 is also
a multiple of every power-of-two MoBA block size up to c/8, so DCA + MoBA needs no rounding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ..options import check_count, file_bool, file_int, plain_number


def _check_optional_int(name: str, value: Any, low: int) -> None:
    if value is not None:  # None: the default
        check_count(name, value, low)


def check_chunk(pretraining_length: int, chunk_size: int) -> None:
    if not 0 < chunk_size < pretraining_length:
        raise ValueError(
            f"DCA chunk_size must satisfy 0 < chunk_size < pretraining_length (valid range 1..{pretraining_length - 1} "
            f"for pretraining_length={pretraining_length}), got chunk_size={chunk_size}"
        )


def default_chunk_size(pretraining_length: int) -> int:
    return pretraining_length - max(1, pretraining_length // 8)


def nearest_multiples(value: int, step: int, upper: int) -> list[int]:
    """Multiples of `step` nearest to `value` (one below, one above) inside (0, upper)."""
    below = (value // step) * step
    return [m for m in (below, below + step) if 0 < m < upper]


@dataclasses.dataclass(frozen=True)
class DcaConfig:
    """Dual Chunk Attention.

    pretraining_length: c, the longest distance the model was trained on. None: the model config's
                        original_max_position_embeddings, else max_position_embeddings.
    chunk_size:         s (< c). None: c - c // 8, or c - local_window when that is given; with sparse MoBA
                        the default is rounded down to a multiple of block_size.
    local_window:       w = c - s, an alternative to chunk_size (ChunkLlama / Qwen think in windows).
    temperature:        scale the logits by max(1, 0.1 ln(L / c) + 1) for L keys (Qwen / vLLM); off by default.
    """

    pretraining_length: int | None = None
    chunk_size: int | None = None
    local_window: int | None = None
    temperature: bool = False

    def __post_init__(self) -> None:
        for name in ("pretraining_length", "chunk_size", "local_window"):  # numpy scalars as Python ints (JSON)
            object.__setattr__(self, name, plain_number(getattr(self, name)))
        _check_optional_int("pretraining_length", self.pretraining_length, 2)
        _check_optional_int("chunk_size", self.chunk_size, 1)
        _check_optional_int("local_window", self.local_window, 1)
        if not isinstance(self.temperature, bool):
            raise ValueError(f"temperature must be true or false, got {self.temperature!r}")
        if self.chunk_size is not None and self.local_window is not None:
            raise ValueError(
                f"give either chunk_size or local_window (= pretraining_length - chunk_size), not both: "
                f"got chunk_size={self.chunk_size}, local_window={self.local_window}"
            )
        if self.pretraining_length is not None:
            c = self.pretraining_length
            if self.chunk_size is not None:
                check_chunk(c, self.chunk_size)
            if self.local_window is not None and not 0 < self.local_window < c:
                raise ValueError(
                    f"DCA local_window must satisfy 0 < local_window < pretraining_length (valid range 1..{c - 1}), "
                    f"got local_window={self.local_window}"
                )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | DcaConfig) -> DcaConfig:
        if isinstance(data, DcaConfig):
            return data
        if not isinstance(data, Mapping):
            raise ValueError(f"a DCA config must be a mapping, got {type(data).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"unknown DCA config keys {unknown}; valid keys: {sorted(known)}")
        # as config files give them: integers may come as digit strings, the switch as "true" / "false"
        values = {
            key: file_bool(key, value) if known[key].type == "bool" else file_int(value) for key, value in data.items()
        }
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class DcaParams:
    """Resolved DCA settings for one model: c, s and the temperature switch."""

    pretraining_length: int
    chunk_size: int
    temperature: bool = False

    @property
    def local_window(self) -> int:
        return self.pretraining_length - self.chunk_size

    def temperature_factor(self, num_keys: int) -> float:
        if not self.temperature or num_keys <= self.pretraining_length:
            return 1.0
        return max(1.0, 0.1 * math.log(num_keys / self.pretraining_length) + 1.0)


def check_block_multiple(chunk_size: int, block_size: int, pretraining_length: int, explicit: bool = True) -> None:
    if chunk_size % block_size == 0:
        return
    valid = nearest_multiples(chunk_size, block_size, pretraining_length)
    hint = f"nearest valid chunk_size: {' or '.join(map(str, valid))}" if valid else "lower block_size"
    source = "chunk_size" if explicit else "default chunk_size"
    raise ValueError(
        f"DCA {source}={chunk_size} must be a multiple of the MoBA block_size={block_size} when both are on "
        f"(so each block lies in one chunk); {hint}, or use dense attention with DCA (sparse=False)"
    )
