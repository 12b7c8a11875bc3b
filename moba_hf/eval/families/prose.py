"""Families in real prose: sentences of Python's reference manual and standard-library docstrings (offline,
texts.prose_sentences; they depend on the Python version, so a run pins their hash).

    family           split    needle (wording drawn per trial)                       answer
    prose-needle     tuning   "Mira Okafor's favourite city is Oslo."                a word, two words, a year
    question-first   heldout  one fact about a person; the question comes before     a name or 3-7 digits
                              the document and again after it
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from .contexts import NAMES, PROSE_INTROS, at_depths, digits, layout, two_words
from .record import HELDOUT, Family, Prompt

CITIES = ("Lisbon", "Kyoto", "Nairobi", "Montreal", "Oslo", "Lima", "Hanoi", "Porto", "Dublin", "Seville")
SPICES = ("saffron", "cardamom", "nutmeg", "tamarind", "fennel", "juniper", "sumac", "lemongrass", "turmeric")
PLACES = ("doormat", "flower pot", "garden gnome", "loose brick", "blue bucket", "porch step", "old boot")

# (needle, question, answer draw): {x} a name, {y} the answer; questions end where the answer comes
PROSE_NEEDLES: tuple[tuple[str, str, Callable[[random.Random], str]], ...] = (
    (
        "{x}'s favourite city is {y}.",
        "What is {x}'s favourite city? {x}'s favourite city is",
        lambda rng: rng.choice(CITIES),
    ),
    (
        "The secret ingredient of {x}'s soup is {y}.",
        "What is the secret ingredient of {x}'s soup? The secret ingredient of {x}'s soup is",
        lambda rng: rng.choice(SPICES),
    ),
    (
        "{x} was born in the year {y}.",
        "In which year was {x} born? {x} was born in the year",
        lambda rng: str(rng.randint(1901, 1999)),
    ),
    (
        "The boat that {x} owns is called the {y}.",
        "What is the boat that {x} owns called? It is called the",
        two_words,
    ),
    (
        "{x} hides the spare key under the {y}.",
        "Where does {x} hide the spare key? Under the",
        lambda rng: rng.choice(PLACES),
    ),
)


def _build_prose(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    """A needle sentence about a person in real prose, cut to exactly `length` tokens."""
    needle, question, answer_of = rng.choice(PROSE_NEEDLES)
    name, intro, answer = rng.choice(NAMES), rng.choice(PROSE_INTROS), answer_of(rng)
    needles = [" " + needle.format(x=name, y=answer)]
    tail = "\n\n" + question.format(x=name)
    ids, starts = layout(
        tokenizer, "prose-needle", length, intro, needles, tail, "prose", at_depths(depth, 1, rng), rng
    )
    return Prompt(ids, answer, starts[0])


PETS = ("Biscuit", "Pepper", "Mochi", "Ziggy", "Clover", "Juniper", "Waffles", "Pickles", "Noodle", "Maple")
# (fact, question, the answer's lead-in, answer draw): {x} a name, {y} the answer
QF_FACTS: tuple[tuple[str, str, str, Callable[[random.Random], str]], ...] = (
    (
        "The name of {x}'s cat is {y}; the cat is called {y}.",
        "What is the name of {x}'s cat?",
        "The name of {x}'s cat is",
        lambda rng: rng.choice(PETS),
    ),
    (
        "{x} stayed in hotel room {y}, room number {y}.",
        "In which hotel room did {x} stay?",
        "{x} stayed in hotel room",
        lambda rng: str(rng.randint(100, 9999)),
    ),
    (
        "The secret number of {x} is {y}. {x}'s secret number is {y}.",
        "What is the secret number of {x}?",
        "The secret number of {x} is",
        lambda rng: digits(rng, 4, 7),
    ),
)


def _build_question_first(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    fact, question, lead, answer_of = rng.choice(QF_FACTS)
    name, answer = rng.choice(NAMES), answer_of(rng)
    head = f"Answer the question using the document below.\nQuestion: {question.format(x=name)}\n\nDocument:"
    tail = f"\n\nQuestion: {question.format(x=name)}\nAnswer: {lead.format(x=name)}"
    needles = [" " + fact.format(x=name, y=answer)]
    ids, starts = layout(
        tokenizer, "question-first", length, head, needles, tail, "prose", at_depths(depth, 1, rng), rng
    )
    return Prompt(ids, answer, starts[0])


FAMILIES = (
    Family("prose-needle", _build_prose, about="a fact about a person in Python's documentation"),
    Family("question-first", _build_question_first, split=HELDOUT, about="a fact in prose, asked before and after it"),
)
