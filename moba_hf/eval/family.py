"""What every prompt family shares: the prompt record, the scoring rule, the family record with its split, and the
wording tables more than one family draws from. `families` (the first three families and the registry) and
`heldout_families` (ten more) both build on it."""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable
from typing import Any

# "tuning": a preset may be chosen on the family; "heldout": reported only, never used to choose
TUNING, HELDOUT = "tuning", "heldout"
SPLIT_NAMES = (TUNING, HELDOUT)

NAMES = (
    "Mira Okafor", "Tomas Lindqvist", "Aiko Tanaka", "Rafael Moreno", "Ingrid Halvorsen", "Kwame Mensah",
    "Lucia Ferraro", "Dmitri Volkov", "Priya Raman", "Owen Gallagher", "Sofia Marquez", "Henrik Bauer",
)  # fmt: skip
PROSE_INTROS = (
    "Read the following text carefully. A question about it comes at the end.",
    "Below is a long document. Remember the facts about people that it mentions.",
    "Here is some reading material, followed by a question.",
)
ADJECTIVES = ("silver", "quiet", "amber", "crimson", "northern", "velvet", "hollow", "golden", "lucky", "pale")


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: list[int]  # the prompt's token ids, special tokens included
    expected: str  # the answer
    needle_token: int  # index in ids of the (asked) needle's first token


def words(text: str) -> list[str]:
    return re.sub(r"[^0-9a-z]+", " ", str(text).lower()).split()


def score(expected: str, output: str) -> tuple[str | None, bool]:
    """(the continuation's first words, as many as the answer has; whether they are the answer's words)."""
    want = words(expected)
    got = words(output)[: len(want)]
    return " ".join(got) or None, bool(want) and got == want


@dataclasses.dataclass(frozen=True)
class Family:
    """A prompt family: `build(tokenizer, length, depth, rng) -> Prompt`, scored by `score` unless it has a
    `scorer` of its own, in one split."""

    name: str
    build: Callable[[Any, int, float, random.Random], Prompt]
    new_tokens: int  # greedy tokens to generate: the longest answer plus a leading space and a spare
    exact: bool  # prompts are exactly `length` tokens (else: at most, by less than one context unit)
    split: str = TUNING
    scorer: Callable[[str, str], tuple[str | None, bool]] | None = None

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
        return (self.scorer or score)(expected, output)

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
