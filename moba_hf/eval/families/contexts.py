"""What every family builds its prompts from: the word tables several families draw from, the token ids of each
context source (one cache for all families), and the layout of a prompt around its needles.

    [special tokens] [head] [context ... NEEDLE ... context] [tail]   exactly `length` tokens

A context is whole units (sentences or lines, each with its leading space or newline) from a drawn start, the
last one cut at a token; a needle goes at the unit boundary nearest its depth x the context's tokens.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from typing import Any

from ... import prompts
from ..texts import (
    code_lines,
    generated_chat,
    generated_log,
    generated_manual,
    generated_rows,
    generated_text,
    prose_sentences,
)

NAMES = (
    "Mira Okafor",
    "Tomas Lindqvist",
    "Aiko Tanaka",
    "Rafael Moreno",
    "Ingrid Halvorsen",
    "Kwame Mensah",
    "Lucia Ferraro",
    "Dmitri Volkov",
    "Priya Raman",
    "Owen Gallagher",
    "Sofia Marquez",
    "Henrik Bauer",
)
PROSE_INTROS = (
    "Read the following text carefully. A question about it comes at the end.",
    "Below is a long document. Remember the facts about people that it mentions.",
    "Here is some reading material, followed by a question.",
)
ADJECTIVES = ("silver", "quiet", "amber", "crimson", "northern", "velvet", "hollow", "golden", "lucky", "pale")
NOUNS = ("heron", "otter", "falcon", "lantern", "harbour", "meadow", "compass", "willow", "comet", "anchor")


def lines(text: str) -> tuple[str, ...]:
    """A wording table written as text, one entry a line (surrounding spaces dropped, blank lines skipped)."""
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def rows(text: str) -> tuple[tuple[str, ...], ...]:
    """A wording table written as text: a row's fields on consecutive lines, a blank line between rows."""
    return tuple(lines(block) for block in re.split(r"\n\s*\n", text.strip()))


def two_words(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"


def digits(rng: random.Random, low: int = 5, high: int = 7) -> str:
    """A number of `low` to `high` digits (the count drawn first)."""
    n = rng.randint(low, high)
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


def distinct(draw: Callable[[], str], n: int) -> list[str]:
    """`n` different values of `draw()`, in the order drawn."""
    values: list[str] = []
    while len(values) < n:
        value = draw()
        if value not in values:
            values.append(value)
    return values


def special(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts around a text (a BOS for Llama-style tokenizers, none for SmolLM2)."""
    return list(tokenizer("").input_ids)


def ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def too_short(name: str, length: int, fixed: int, needles: int = 1) -> ValueError:
    around = "needles" if needles > 1 else "needle"
    return ValueError(
        f"length={length} leaves no room for the {name} context around its {around} and question ({fixed} tokens)"
    )


def _story_sentences() -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", generated_text(40_000, seed=0)) if s.strip()]


# source -> its units as text, each with its leading space or newline
SOURCES: dict[str, Callable[[], list[str]]] = {
    "prose": lambda: [" " + " ".join(s.split()) for s in prose_sentences()],  # Python's docs (texts.py)
    "story": lambda: [" " + " ".join(s.split()) for s in _story_sentences()],  # texts.generated_text
    "landmark": lambda: [" " + s for s in re.split(r"(?<=\.)\s+", prompts.FILLER)],  # the passkey filler
    "code": lambda: ["\n" + line for line in code_lines()],
    "rows": lambda: ["\n" + row for row in generated_rows(3000)],
    "log": lambda: ["\n" + line for line in generated_log(3000)],
    "chat": lambda: ["\n" + line for line in generated_chat(3000)],
    "manual": lambda: [" " + sentence for sentence in generated_manual(3000)],
}

_UNIT_IDS: dict[tuple[str, str, int], list[list[int]]] = {}


def unit_ids(tokenizer: Any, source: str) -> list[list[int]]:
    """Token ids of every unit of a context source (tokenized once per tokenizer)."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    key = (source, getattr(tokenizer, "name_or_path", ""), tokenizer.vocab_size)
    if key not in _UNIT_IDS:
        texts = SOURCES[source]()
        _UNIT_IDS[key] = [list(x) for x in tokenizer(texts, add_special_tokens=False).input_ids]
    return _UNIT_IDS[key]


def context(tokenizer: Any, source: str, budget: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """`budget` tokens of whole units from a drawn start (the Landmark filler from its first sentence; the last
    unit cut), and the unit boundaries."""
    units = unit_ids(tokenizer, source)
    i = 0 if source == "landmark" else rng.randrange(len(units))
    tokens, bounds = [], [0]
    while len(tokens) < budget:
        tokens += units[i % len(units)]
        bounds.append(len(tokens))
        i += 1
    return tokens[:budget], [b for b in bounds if b < budget] + [budget]


def nearest(bounds: list[int], target: float) -> int:
    return min(bounds, key=lambda b: (abs(b - target), b))


# places(bounds, budget) -> the token offset in the context of each needle, the asked one first
Places = Callable[[list[int], int], list[int]]


def at_depths(depth: float, n: int, rng: random.Random) -> Places:
    """The asked needle at `depth`, the n - 1 others at depths drawn now (before the context's start)."""
    draws = [rng.random() for _ in range(n - 1)]

    def places(bounds: list[int], budget: int) -> list[int]:
        return [nearest(bounds, depth * budget), *(nearest(bounds, d * budget) for d in draws)]

    return places


def layout(
    tokenizer: Any,
    name: str,
    length: int,
    head: str,
    needles: Sequence[str],
    tail: str,
    source: str,
    places: Places,
    rng: random.Random,
) -> tuple[list[int], list[int]]:
    """[special tokens] head [context with the needles at places(bounds, budget)] tail, exactly `length` tokens;
    (ids, each needle's first token index)."""
    head_ids = special(tokenizer) + ids(tokenizer, head)
    needle_ids = [ids(tokenizer, n) for n in needles]
    tail_ids = ids(tokenizer, tail)
    budget = length - len(head_ids) - sum(map(len, needle_ids)) - len(tail_ids)
    if budget < 1:
        raise too_short(name, length, length - budget, len(needles))
    tokens, bounds = context(tokenizer, source, budget, rng)
    at = places(bounds, budget)
    out, start, starts = list(head_ids), 0, [0] * len(needles)
    for where, i in sorted((where, i) for i, where in enumerate(at)):
        out += tokens[start:where]
        starts[i] = len(out)
        out += needle_ids[i]
        start = where
    out += tokens[start:] + tail_ids
    return out, starts
