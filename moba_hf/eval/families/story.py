"""Families in generated story sentences (texts.generated_text):

    family          split    needles (wording drawn per trial)                          answer
    kv-retrieval    tuning   3 "Aiko Tanaka's locker code is 481207." with distinct     6 digits, hex code,
                             names; one is asked for                                    2 words
    serial-needle   heldout  "The serial number of Mira Okafor's laptop is 7f3a-91c2.   UUID-like hex groups,
                             I repeat, ..."                                              8 digits

A list of hundreds of "key: value" records (8-hex-digit, 4-digit or word keys) was tried for kv-retrieval:
dense SmolLM2-135M answered none at 512 tokens, so it could not tell settings apart; three key-value needles
among story sentences keep the distractor difficulty at a level dense attention solves.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from .contexts import NAMES, PROSE_INTROS, at_depths, distinct, layout, nearest, rows, two_words
from .record import HELDOUT, Family, Prompt

KV_VALUES: tuple[Callable[[random.Random], str], ...] = (
    lambda rng: str(rng.randint(100000, 999999)),  # digits
    lambda rng: f"{rng.getrandbits(24):06x}",  # hex code
    two_words,
)
# (needle with {k} and {v}, question with {k}): one wording per trial for all its needles; keys are NAMES
KV_NEEDLES = rows("""
    {k}'s locker code is {v}.
    What is {k}'s locker code? {k}'s locker code is

    The access code for {k}'s room is {v}.
    What is the access code for {k}'s room? The access code for {k}'s room is

    The password that {k} chose is {v}.
    What is the password that {k} chose? The password that {k} chose is
""")
N_NEEDLES = 3  # the asked one and two distractors


def _build_kv(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    """N_NEEDLES key-value needles of one wording and value format in generated story text, exactly `length`
    tokens; the asked one at `depth`, the others at depths drawn after the context's start."""
    needle, question = rng.choice(KV_NEEDLES)
    value_of = rng.choice(KV_VALUES)
    keys = rng.sample(NAMES, N_NEEDLES)
    values = distinct(lambda: value_of(rng), N_NEEDLES)
    intro = rng.choice(PROSE_INTROS)
    needles = [" " + needle.format(k=k, v=v) for k, v in zip(keys, values, strict=True)]

    def places(bounds: list[int], budget: int) -> list[int]:
        others = (nearest(bounds, rng.random() * budget) for _ in needles[1:])
        return [nearest(bounds, depth * budget), *others]

    tail = "\n\n" + question.format(k=keys[0])
    ids, starts = layout(tokenizer, "kv-retrieval", length, intro, needles, tail, "story", places, rng)
    return Prompt(ids, values[0], starts[0])


DEVICES = ("laptop", "camera", "bicycle", "radio", "printer", "telescope")
# (needle, question): {x} a name, {d} a device, {u} the serial number
SERIAL_NEEDLES = rows("""
    The serial number of {x}'s {d} is {u}. I repeat, the serial number is {u}.
    What is the serial number of {x}'s {d}? The serial number is

    {x} wrote the {d}'s serial number on a card: {u}. The serial number is {u}.
    Which serial number did {x} write on the card? The serial number is

    The {d} that {x} bought has serial number {u}, that is {u}.
    What serial number does the {d} that {x} bought have? It has serial number
""")


def _serial(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 2:
        return str(rng.randint(10**7, 10**8 - 1))
    return "-".join(f"{rng.getrandbits(16):04x}" for _ in range(kind + 2))


def _build_serial(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    needle, question = rng.choice(SERIAL_NEEDLES)
    name, device, answer = rng.choice(NAMES), rng.choice(DEVICES), _serial(rng)
    intro = rng.choice(PROSE_INTROS)
    needles = [" " + needle.format(x=name, d=device, u=answer)]
    tail = "\n\n" + question.format(x=name, d=device)
    ids, starts = layout(
        tokenizer, "serial-needle", length, intro, needles, tail, "story", at_depths(depth, 1, rng), rng
    )
    return Prompt(ids, answer, starts[0])


FAMILIES = (
    Family("kv-retrieval", _build_kv, new_tokens=12, about="one of three key-value facts in story sentences"),
    Family("serial-needle", _build_serial, new_tokens=20, split=HELDOUT, about="a serial number in story sentences"),
)
