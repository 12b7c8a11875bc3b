"""Prompt families: one retrieval question (find a fact hidden in a long context and say it) asked over
different kinds of text, so that a setting is judged on its worst family rather than on one prompt's quirks.

    family         context                                       needles (wording drawn per trial)        answer
    passkey        Landmark filler "The grass is green. ..."     "The pass key is 48213. Remember it..."  4-7 digits
    prose-needle   sentences of Python's reference manual and    "Mira Okafor's favourite city is Oslo."  a word, two
                   stdlib docstrings (offline, texts.py)                                                  words, a year
    kv-retrieval   generated story sentences                     3 "Aiko Tanaka's locker code is 481207."  6 digits, hex
                   (texts.generated_text)                        with distinct names; one is asked for    code, 2 words

    [special tokens] [intro] [context ... NEEDLE ... context] [question]   -> greedy continuation, scored

A list of hundreds of "key: value" records (8-hex-digit, 4-digit or word keys) was tried for kv-retrieval:
dense SmolLM2-135M answered none at 512 tokens, so it could not tell settings apart; three key-value needles
among story sentences keep the distractor difficulty at a level dense attention solves.

Every trial draws the intro, needle wording, question, answer format and answer from
random.Random(f"{family}:{seed}:{length}:{depth}:{trial}"): every setting sees the same prompts (a paired
comparison), and so does every re-run.

Length (special tokens included): prose-needle and kv-retrieval prompts are exactly `length` tokens (the
context is cut at a token, so its last sentence may end early); passkey prompts hold whole filler sentences
(prompts.py's builder), so they are `length` tokens or fewer, by less than one filler (under 32 tokens).
Depth: the (asked) needle goes after round(depth * n) of the n fillers (passkey) or at the sentence boundary
nearest depth x the context's tokens: depth 0 is right after the intro, 1 right before the question.
Scoring (all families): the continuation's first words must be the answer's words, compared lower-cased
with punctuation and whitespace runs read as one space ("  Oslo." matches "oslo"; "12345" does not match
"1234").
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Sequence
from typing import Any

from .. import prompts
from .family import ADJECTIVES, NAMES, PROSE_INTROS, SPLIT_NAMES, Family, Prompt, score  # noqa: F401 (Prompt, score: re-exported)
from .texts import generated_text, prose_digest, prose_sentences

_CITIES = ("Lisbon", "Kyoto", "Nairobi", "Montreal", "Oslo", "Lima", "Hanoi", "Porto", "Dublin", "Seville")
_SPICES = ("saffron", "cardamom", "nutmeg", "tamarind", "fennel", "juniper", "sumac", "lemongrass", "turmeric")
_NOUNS = ("heron", "otter", "falcon", "lantern", "harbour", "meadow", "compass", "willow", "comet", "anchor")
_PLACES = ("doormat", "flower pot", "garden gnome", "loose brick", "blue bucket", "porch step", "old boot")


def _two_words(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)} {rng.choice(_NOUNS)}"


# (needle, question, answer draw): {x} a name, {y} the answer; questions end where the answer comes
PROSE_NEEDLES: tuple[tuple[str, str, Callable[[random.Random], str]], ...] = (
    ("{x}'s favourite city is {y}.", "What is {x}'s favourite city? {x}'s favourite city is",
     lambda rng: rng.choice(_CITIES)),
    ("The secret ingredient of {x}'s soup is {y}.",
     "What is the secret ingredient of {x}'s soup? The secret ingredient of {x}'s soup is",
     lambda rng: rng.choice(_SPICES)),
    ("{x} was born in the year {y}.", "In which year was {x} born? {x} was born in the year",
     lambda rng: str(rng.randint(1901, 1999))),
    ("The boat that {x} owns is called the {y}.", "What is the boat that {x} owns called? It is called the",
     _two_words),
    ("{x} hides the spare key under the {y}.", "Where does {x} hide the spare key? Under the",
     lambda rng: rng.choice(_PLACES)),
)  # fmt: skip

KV_VALUES: tuple[Callable[[random.Random], str], ...] = (
    lambda rng: str(rng.randint(100000, 999999)),  # digits
    lambda rng: f"{rng.getrandbits(24):06x}",  # hex code
    _two_words,
)


def _special(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts around a text (a BOS for Llama-style tokenizers, none for SmolLM2)."""
    return list(tokenizer("").input_ids)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _build_passkey(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    """The passkey prompt builder (prompts.py) with a drawn wording and a 4-7 digit passkey."""
    wording = rng.randrange(len(prompts.WORDINGS))
    digits = rng.randint(4, 7)
    key = rng.randint(10 ** (digits - 1), 10**digits - 1)
    specials = len(_special(tokenizer))
    text = prompts.build_prompt(tokenizer, length - specials, depth, key, wording=wording)
    ids = list(tokenizer(text).input_ids)
    if len(ids) > length:
        raise _too_short("passkey", length, len(ids))
    before = text[: text.index(prompts.passkey_line(key, wording))].rstrip()
    return Prompt(ids, str(key), len(tokenizer(before).input_ids))


_SENTENCE_IDS: dict[tuple[str, str, int], list[list[int]]] = {}


def _sentence_ids(tokenizer: Any, source: str = "prose") -> list[list[int]]:
    """Token ids of every sentence of a context source, each with its leading space (cached per tokenizer):
    "prose" = texts.prose_sentences(), "story" = the sentences of texts.generated_text()."""
    key = (source, getattr(tokenizer, "name_or_path", ""), tokenizer.vocab_size)
    if key not in _SENTENCE_IDS:
        if source == "prose":
            sentences = prose_sentences()
        else:
            sentences = [s for s in re.split(r"(?<=[.!?])\s+", generated_text(40_000, seed=0)) if s.strip()]
        ids = tokenizer([" " + " ".join(s.split()) for s in sentences], add_special_tokens=False).input_ids
        _SENTENCE_IDS[key] = [list(x) for x in ids]
    return _SENTENCE_IDS[key]


def _context(tokenizer: Any, source: str, budget: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """`budget` tokens of whole sentences from a drawn start (the last one cut), and the sentence boundaries."""
    sentences = _sentence_ids(tokenizer, source)
    i = rng.randrange(len(sentences))
    context, bounds = [], [0]
    while len(context) < budget:
        context += sentences[i % len(sentences)]
        bounds.append(len(context))
        i += 1
    return context[:budget], [b for b in bounds if b < budget] + [budget]


def _nearest(bounds: list[int], target: float) -> int:
    return min(bounds, key=lambda b: (abs(b - target), b))


def _too_short(name: str, length: int, fixed: int) -> ValueError:
    return ValueError(f"length={length} leaves no room for the {name} context around its needle and question "
                      f"({fixed} tokens)")  # fmt: skip


def _build_prose(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    """A needle sentence about a person in real prose, cut to exactly `length` tokens."""
    needle, question, answer_of = rng.choice(PROSE_NEEDLES)
    name, intro, answer = rng.choice(NAMES), rng.choice(PROSE_INTROS), answer_of(rng)
    head = _special(tokenizer) + _ids(tokenizer, intro)
    needle_ids = _ids(tokenizer, " " + needle.format(x=name, y=answer))
    tail = _ids(tokenizer, "\n\n" + question.format(x=name))
    budget = length - len(head) - len(needle_ids) - len(tail)
    if budget < 1:
        raise _too_short("prose-needle", length, length - budget)
    context, bounds = _context(tokenizer, "prose", budget, rng)
    at = _nearest(bounds, depth * budget)
    ids = head + context[:at] + needle_ids + context[at:] + tail
    return Prompt(ids, answer, len(head) + at)


# (needle with {k} and {v}, question with {k}): one wording per trial for all its needles; keys are NAMES
KV_NEEDLES = (
    ("{k}'s locker code is {v}.", "What is {k}'s locker code? {k}'s locker code is"),
    ("The access code for {k}'s room is {v}.",
     "What is the access code for {k}'s room? The access code for {k}'s room is"),
    ("The password that {k} chose is {v}.", "What is the password that {k} chose? The password that {k} chose is"),
)  # fmt: skip
N_NEEDLES = 3  # the asked one and two distractors


def _build_kv(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    """N_NEEDLES key-value needles of one wording and value format in generated story text, exactly `length`
    tokens; the asked one at `depth`, the others at drawn depths."""
    needle, question = rng.choice(KV_NEEDLES)
    value_of = rng.choice(KV_VALUES)
    keys = rng.sample(NAMES, N_NEEDLES)
    values: list[str] = []
    while len(values) < N_NEEDLES:
        value = value_of(rng)
        if value not in values:
            values.append(value)
    head = _special(tokenizer) + _ids(tokenizer, rng.choice(PROSE_INTROS))
    needles = [_ids(tokenizer, " " + needle.format(k=k, v=v)) for k, v in zip(keys, values, strict=True)]
    tail = _ids(tokenizer, "\n\n" + question.format(k=keys[0]))
    budget = length - len(head) - sum(map(len, needles)) - len(tail)
    if budget < 1:
        raise _too_short("kv-retrieval", length, length - budget)
    context, bounds = _context(tokenizer, "story", budget, rng)
    places = [_nearest(bounds, depth * budget), *(_nearest(bounds, rng.random() * budget) for _ in needles[1:])]
    ids, start, target = list(head), 0, 0
    for at, i in sorted((at, i) for i, at in enumerate(places)):
        ids += context[start:at]
        if i == 0:
            target = len(ids)
        ids += needles[i]
        start = at
    ids += context[start:] + tail
    return Prompt(ids, values[0], target)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("passkey", _build_passkey, new_tokens=10, exact=False),
        Family("prose-needle", _build_prose, new_tokens=10, exact=True),
        Family("kv-retrieval", _build_kv, new_tokens=12, exact=True),
    )
}
ALL = tuple(FAMILIES)


def parse_families(spec: str | Sequence[str] | None) -> list[str]:
    """'passkey,kv-retrieval' (or a list) -> known family names, in the given order, without repeats."""
    if spec is None:
        return list(ALL)
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if not names or unknown:
        raise ValueError(f"families must be names among {', '.join(FAMILIES)}, got {spec!r}"
                         + (f" (unknown: {', '.join(unknown)})" if unknown else ""))  # fmt: skip
    return list(dict.fromkeys(names))


def by_split() -> dict[str, list[str]]:
    """{"tuning": [names], "heldout": [names]}, in registry order: the layout of the `--families` help."""
    return {split: [name for name in FAMILIES if SPLITS[name] == split] for split in SPLIT_NAMES}


def check_fits(tokenizer: Any, families: Sequence[str], lengths: Sequence[int]) -> None:
    """Every length must hold every family's prompt (raises ValueError naming the family and the minimum)."""
    for name in families:
        shortest = FAMILIES[name].min_length(tokenizer)
        if min(lengths) < shortest:
            raise ValueError(f"lengths must be >= {shortest} tokens to hold the {name} prompt, got {min(lengths)}")


def wording_digest() -> str:
    """A hash of the families' wording tables: a resume after they change is refused, not mixed."""
    tables = [prompts.INTRO, prompts.FILLER, prompts.WORDINGS, NAMES, _CITIES, _SPICES, ADJECTIVES, _NOUNS,
              _PLACES, [needle[:2] for needle in PROSE_NEEDLES], PROSE_INTROS, KV_NEEDLES, N_NEEDLES]  # fmt: skip
    return hashlib.sha1(json.dumps(tables).encode()).hexdigest()[:16]


def text_params(families: Sequence[str]) -> dict[str, Any]:
    """Run parameters that pin the families' texts: their wordings and the prose (which depends on the
    Python version)."""
    params = {"wording_sha1": wording_digest()}
    if {"prose-needle", "question-first"} & set(families):
        params["prose_sha1"] = prose_digest()
    if set(families) - set(ALL):
        params["heldout_wording_sha1"] = heldout_families.wording_digest()
    return params


# more families (heldout_families.py), each with a split: "tuning" (presets may be chosen on it) or "heldout"
# (reported only); ALL, the default, stays the three above
from . import heldout_families  # noqa: E402

FAMILIES.update(heldout_families.FAMILIES)
SPLITS: dict[str, str] = {name: f.split for name, f in FAMILIES.items()}
# a few words per family for `--families` help (the module docstrings hold the details)
ABOUT: dict[str, str] = {
    "passkey": "a number in Landmark filler",
    "prose-needle": "a fact about a person in Python's documentation",
    "kv-retrieval": "one of three key-value facts in story sentences",
    "word-passkey": "a word in Landmark filler",
    "list-lookup": "a code in a household inventory list",
    "code-needle": "a constant's value in Python source",
    "serial-needle": "a serial number in story sentences",
    "question-first": "a fact in prose, asked before and after it",
    "multi-needle-one": "one of three coloured pass keys",
    "multi-label-one": "one of three labelled codes in an inventory list",
    "log-lookup": "a number in a service log",
    "chat-lookup": "a number in a group chat",
    "manual-lookup": "a number in an appliance manual",
}
