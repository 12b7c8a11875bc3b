"""A prompt family as a record: its name, prompt builder, answer length, split, description and scorer."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

from ..scoring import score_words

# "tuning": a preset may be chosen on the family; "heldout": reported only, never used to choose
TUNING, HELDOUT = "tuning", "heldout"
SPLIT_NAMES = (TUNING, HELDOUT)


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: list[int]  # the prompt's token ids, special tokens included
    expected: str  # the answer
    needle_token: int  # index in ids of the (asked) needle's first token


@dataclasses.dataclass(frozen=True)
class Family:
    """A prompt family: `build(tokenizer, length, depth, rng) -> Prompt`, scored by `scorer`, in one split."""

    name: str
    build: Callable[[Any, int, float, random.Random], Prompt]
    new_tokens: int = 10  # greedy tokens to generate: the longest answer plus a leading space and a spare
    exact: bool = True  # prompts are exactly `length` tokens (else: at most, by less than one context unit)
    split: str = TUNING
    about: str = ""  # a few words for the `--families` help
    scorer: Callable[[str, str], tuple[str | None, bool]] = score_words

    def __post_init__(self) -> None:
        if self.split not in SPLIT_NAMES:
            raise ValueError(f"split must be one of {', '.join(SPLIT_NAMES)}, got {self.split!r}")

    def rng(self, seed: int, length: int, depth: float, trial: int) -> random.Random:
        return random.Random(f"{self.name}:{seed}:{length}:{depth}:{trial}")

    def prompt(self, tokenizer: Any, seed: int, length: int, depth: float, trial: int) -> Prompt:
        """The prompt of one grid cell: the same for every setting and every re-run."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        return self.build(tokenizer, length, depth, self.rng(seed, length, depth, trial))

    def score(self, expected: str, output: str) -> tuple[str | None, bool]:
        return self.scorer(expected, output)

    def min_length(self, tokenizer: Any) -> int:
        """A length that holds every wording with some context: the shortest that 64 draws at depth 0.5
        built, plus 16 tokens (answers and names vary in tokens)."""
        n = 32
        for trial in range(64):
            while True:
                try:
                    self.build(tokenizer, n, 0.5, self.rng(0, 0, 0.5, trial))
                    break
                except ValueError:
                    n += 8
        return n + 16
