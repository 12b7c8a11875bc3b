"""Families in the Landmark passkey filler ("The grass is green. The sky is blue. ..."):

    family             split    needle (wording drawn per trial)                              answer
    passkey            tuning   "The pass key is 48213. Remember it. 48213 is the pass key."  4-7 digits
    word-passkey       tuning   "The magic word is heron. Remember it. heron is the magic     a word or two words
                                word."
    multi-needle-one   heldout  3 "The red pass key is 48213. ..." of distinct colours; one   4-7 digits
                                is asked

passkey is prompts.py's builder (the prompt `moba-hf eval passkey` and training share): whole filler sentences,
so its prompts are `length` tokens or fewer, by less than one filler (under 32 tokens), and the needle goes after
round(depth * n) of the n fillers. The other two are exactly `length` tokens, the filler from its first sentence.
"""

from __future__ import annotations

import random
from typing import Any

from ... import prompts
from .contexts import ADJECTIVES, at_depths, digits, distinct, layout, rows, special, too_short
from .record import HELDOUT, Family, Prompt


def _build_passkey(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    """The passkey prompt builder (prompts.py) with a drawn wording and a 4-7 digit passkey."""
    wording = rng.randrange(len(prompts.WORDINGS))
    n_digits = rng.randint(4, 7)
    key = rng.randint(10 ** (n_digits - 1), 10**n_digits - 1)
    specials = len(special(tokenizer))
    text = prompts.build_prompt(tokenizer, length - specials, depth, key, wording=wording)
    ids = list(tokenizer(text).input_ids)
    if len(ids) > length:
        raise too_short("passkey", length, len(ids))
    before = text[: text.index(prompts.passkey_line(key, wording))].rstrip()
    return Prompt(ids, str(key), len(tokenizer(before).input_ids))


WORDS = tuple(
    "heron otter falcon lantern harbour meadow compass willow comet anchor violin pepper glacier marble thistle "
    "copper orchid badger saffron tulip".split()
)
# (needle with {w}, question)
WORD_NEEDLES = rows("""
    The magic word is {w}. Remember it. {w} is the magic word.
    What is the magic word? The magic word is

    The password for the garden gate is {w}. Again, the password for the garden gate is {w}.
    What is the password for the garden gate? The password for the garden gate is

    Remember this word: {w}. The word to remember is {w}.
    What is the word to remember? The word to remember is
""")


def _build_word_passkey(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    needle, question = rng.choice(WORD_NEEDLES)
    answer = rng.choice(WORDS) if rng.random() < 0.5 else f"{rng.choice(ADJECTIVES)} {rng.choice(WORDS)}"
    needles = [" " + needle.format(w=answer)]
    places = at_depths(depth, 1, rng)
    ids, starts = layout(
        tokenizer, "word-passkey", length, prompts.INTRO, needles, " " + question, "landmark", places, rng
    )
    return Prompt(ids, answer, starts[0])


COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black")
# (needle with {c} a colour and {v} its number, question with {c})
MULTI_ONE_NEEDLES = rows("""
    The {c} pass key is {v}. Remember it. {v} is the {c} pass key.
    What is the {c} pass key? The {c} pass key is

    The code of the {c} door is {v}. The {c} door opens with {v}.
    What is the code of the {c} door? The code of the {c} door is

    Keep the {c} number in mind: {v}. The {c} number is {v}.
    What is the {c} number? The {c} number is
""")


def _build_multi_one(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    needle, question = rng.choice(MULTI_ONE_NEEDLES)
    n_digits = rng.randint(4, 7)
    colours = rng.sample(COLOURS, 3)
    values = distinct(lambda: digits(rng, n_digits, n_digits), 3)
    needles = [" " + needle.format(c=c, v=v) for c, v in zip(colours, values, strict=True)]
    tail = " " + question.format(c=colours[0])
    places = at_depths(depth, 3, rng)
    ids, starts = layout(tokenizer, "multi-needle-one", length, prompts.INTRO, needles, tail, "landmark", places, rng)
    return Prompt(ids, values[0], starts[0])


FAMILIES = (
    Family("passkey", _build_passkey, exact=False, about="a number in Landmark filler"),
    Family("word-passkey", _build_word_passkey, new_tokens=8, about="a word in Landmark filler"),
    Family("multi-needle-one", _build_multi_one, split=HELDOUT, about="one of three coloured pass keys"),
)
