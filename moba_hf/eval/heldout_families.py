"""More prompt families, each chosen as one that dense attention on the embedded SmolLM2-135M-Instruct answers,
so that a sparse setting's loss shows; families.py adds them to `families.FAMILIES` and lists every family's
split in `families.SPLITS`: "tuning" (a preset may be chosen on it; so are passkey, prose-needle and
kv-retrieval) or "heldout" (reported only, never used to choose).

    family             split    context                         needle                                 answer
    word-passkey       tuning   Landmark filler, repeated       "The magic word is heron. Remember     a word or
                                                                it. heron is the magic word."          two words
    list-lookup        tuning   household inventory lines       "- NOTE: the alarm code is 583921.     5-7 digits
                                (bullets, table rows)           The alarm code is 583921."
    code-needle        heldout  Python stdlib source lines      'SECRET_KEY = "583921"  # SECRET_KEY   5-7 digits or
                                                                is 583921'                             6 hex digits
    serial-needle      heldout  generated story sentences       "The serial number of Mira Okafor's    UUID-like hex
                                                                laptop is 7f3a-91c2. I repeat, ..."    groups, 8 digits
    question-first     heldout  Python reference / docstring    one fact about a person; the question  a name or
                                prose                           before the document and again after    3-7 digits
    multi-needle-one   heldout  Landmark filler                 3 "The red pass key is 48213. ..."     4-7 digits
                                                                of distinct colours; one is asked
    multi-label-one    heldout  household inventory lines       3 "* Reminder: the alarm code is       5-7 digits
                                (bullets, table rows)           583921. ..." of distinct labels; one
                                                                is asked
    log-lookup         heldout  service log lines, no digits    "[WARN] vault: the recovery code is    4-7 digits
                                                                30775. Repeat: ..."
    chat-lookup        heldout  group chat messages, no digits  "Gwen: the conference room PIN is      4-7 digits
                                                                7863, I repeat, 7863."
    manual-lookup      heldout  appliance manual sentences,     "Important: the child lock PIN is      4-7 digits
                                no digits                       5468. Write it down: 5468."

Length: every prompt is exactly `length` tokens, special tokens included (the context is cut at a token).
Depth: the (asked) needle sits at the context unit boundary (sentence, filler sentence or line) nearest
depth x the context's tokens: 0 is right after the intro, 1 right before the question; the two other needles of
multi-needle-one and multi-label-one sit at drawn depths.
Seeds and scoring as in families.py: random.Random(f"{family}:{seed}:{length}:{depth}:{trial}"), and the
continuation's first words must be every word of the answer (all digits of a code, every hex group).

Tried and left out, dense 0/5 at 4096 tokens: all of 2-3 numbered pass keys in Landmark filler (the model
repeats the first key or starts a list), and a RULER-style chain "VAR QXK = 48213. ... VAR BRT = VAR QXK."
asked for the last name's value (it answers a variable name).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Callable, Sequence
from typing import Any

from .. import prompts
from .family import ADJECTIVES, HELDOUT, NAMES, PROSE_INTROS, TUNING, Family, Prompt
from .texts import (
    code_lines,
    generated_chat,
    generated_log,
    generated_manual,
    generated_rows,
    generated_text,
    prose_sentences,
)


def _special(tokenizer: Any) -> list[int]:
    return list(tokenizer("").input_ids)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _nearest(bounds: list[int], target: float) -> int:
    return min(bounds, key=lambda b: (abs(b - target), b))


def _too_short(name: str, length: int, fixed: int) -> ValueError:
    return ValueError(f"length={length} leaves no room for the {name} context around its needles and question "
                      f"({fixed} tokens)")  # fmt: skip


# ---- context sources: token ids of units (sentences or lines), each with its leading space or newline ----

_UNIT_IDS: dict[tuple[str, str, int], list[list[int]]] = {}


def _units(tokenizer: Any, source: str) -> list[list[int]]:
    key = (source, getattr(tokenizer, "name_or_path", ""), tokenizer.vocab_size)
    if key not in _UNIT_IDS:
        if source == "prose":  # families.py's prose-needle haystack
            texts = [" " + " ".join(s.split()) for s in prose_sentences()]
        elif source == "story":  # families.py's kv-retrieval haystack
            story = re.split(r"(?<=[.!?])\s+", generated_text(40_000, seed=0))
            texts = [" " + " ".join(s.split()) for s in story if s.strip()]
        elif source == "landmark":
            texts = [" " + s for s in re.split(r"(?<=\.)\s+", prompts.FILLER)]
        elif source == "code":
            texts = ["\n" + line for line in code_lines()]
        elif source == "rows":
            texts = ["\n" + row for row in generated_rows(3000)]
        elif source == "log":
            texts = ["\n" + line for line in generated_log(3000)]
        elif source == "chat":
            texts = ["\n" + line for line in generated_chat(3000)]
        elif source == "manual":
            texts = [" " + sentence for sentence in generated_manual(3000)]
        else:
            raise ValueError(f"unknown context source {source!r}")
        _UNIT_IDS[key] = [list(x) for x in tokenizer(texts, add_special_tokens=False).input_ids]
    return _UNIT_IDS[key]


def _context(tokenizer: Any, source: str, budget: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """`budget` tokens of whole units from a drawn start (the Landmark filler from its first sentence; the last
    unit cut), and the unit boundaries."""
    units = _units(tokenizer, source)
    i = 0 if source == "landmark" else rng.randrange(len(units))
    context, bounds = [], [0]
    while len(context) < budget:
        context += units[i % len(units)]
        bounds.append(len(context))
        i += 1
    return context[:budget], [b for b in bounds if b < budget] + [budget]


def _layout(
    tokenizer: Any,
    name: str,
    length: int,
    head: str,
    needles: Sequence[str],
    tail: str,
    source: str,
    places: Callable[[list[int], int], list[int]],
    rng: random.Random,
) -> tuple[list[int], list[int]]:
    """[special tokens] head [context with the needles at places(bounds, budget)] tail, exactly `length` tokens;
    (ids, each needle's first token index)."""
    head_ids = _special(tokenizer) + _ids(tokenizer, head)
    needle_ids = [_ids(tokenizer, n) for n in needles]
    tail_ids = _ids(tokenizer, tail)
    budget = length - len(head_ids) - sum(map(len, needle_ids)) - len(tail_ids)
    if budget < 1:
        raise _too_short(name, length, length - budget)
    context, bounds = _context(tokenizer, source, budget, rng)
    at = places(bounds, budget)
    ids, start, starts = list(head_ids), 0, [0] * len(needles)
    for where, i in sorted((where, i) for i, where in enumerate(at)):
        ids += context[start:where]
        starts[i] = len(ids)
        ids += needle_ids[i]
        start = where
    ids += context[start:] + tail_ids
    return ids, starts


def _places(depth: float, n: int, rng: random.Random) -> Callable[[list[int], int], list[int]]:
    draws = [rng.random() for _ in range(n - 1)]

    def places(bounds: list[int], budget: int) -> list[int]:
        return [_nearest(bounds, depth * budget), *(_nearest(bounds, d * budget) for d in draws)]

    return places


def _digits(rng: random.Random, low: int = 5, high: int = 7) -> str:
    n = rng.randint(low, high)
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


def _distinct(draw: Callable[[], str], n: int) -> list[str]:
    values: list[str] = []
    while len(values) < n:
        value = draw()
        if value not in values:
            values.append(value)
    return values


# ---- word-passkey: Landmark filler, a word (or two) to remember ----

WORDS = (
    "heron", "otter", "falcon", "lantern", "harbour", "meadow", "compass", "willow", "comet", "anchor", "violin",
    "pepper", "glacier", "marble", "thistle", "copper", "orchid", "badger", "saffron", "tulip",
)  # fmt: skip
WORD_NEEDLES = (
    ("The magic word is {w}. Remember it. {w} is the magic word.", "What is the magic word? The magic word is"),
    ("The password for the garden gate is {w}. Again, the password for the garden gate is {w}.",
     "What is the password for the garden gate? The password for the garden gate is"),
    ("Remember this word: {w}. The word to remember is {w}.",
     "What is the word to remember? The word to remember is"),
)  # fmt: skip


def _word_answer(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return rng.choice(WORDS)
    return f"{rng.choice(ADJECTIVES)} {rng.choice(WORDS)}"


def _build_word_passkey(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    needle, question = rng.choice(WORD_NEEDLES)
    answer = _word_answer(rng)
    ids, starts = _layout(tokenizer, "word-passkey", length, prompts.INTRO, [" " + needle.format(w=answer)],
                          " " + question, "landmark", _places(depth, 1, rng), rng)  # fmt: skip
    return Prompt(ids, answer, starts[0])


# ---- list-lookup: a household inventory, one line with a number ----

LIST_INTROS = (
    "Below is a household inventory list. One line of it holds a number; a question about it follows.",
    "Here is a long list of things in a house and where they are kept. Remember the number in it.",
)
LIST_LABELS = ("alarm code", "safe combination", "storage unit number", "bike lock code", "locker number")
LIST_NEEDLE = "\n- NOTE: the {label} is {v}. The {label} is {v}."
LIST_QUESTIONS = (
    "\n\nWhat is the {label}? The {label} is",
    "\n\nQuestion: what is the {label} in the list? Answer: the {label} is",
    "\n\nLook at the list above. The {label} is",
)


def _labelled_number(
    name: str,
    source: str,
    intros: Sequence[str],
    labels: Sequence[str],
    needle: str,
    questions: Sequence[str],
    digits: tuple[int, int],
) -> Callable[[Any, int, float, random.Random], Prompt]:
    """The builder of a family with one "the {label} is {v}" needle line in a `source` haystack: label, intro,
    question and a number of `digits` (low, high) drawn in that order."""

    def build(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
        label, intro, question = rng.choice(labels), rng.choice(intros), rng.choice(questions)
        answer = _digits(rng, *digits)
        ids, starts = _layout(tokenizer, name, length, intro, [needle.format(label=label, v=answer)],
                              question.format(label=label), source, _places(depth, 1, rng), rng)  # fmt: skip
        return Prompt(ids, answer, starts[0])

    return build


_build_list = _labelled_number("list-lookup", "rows", LIST_INTROS, LIST_LABELS, LIST_NEEDLE, LIST_QUESTIONS, (5, 7))


# ---- code-needle: a constant in Python source ----

CODE_NAMES = ("SECRET_KEY", "BUILD_NUMBER", "LICENSE_CODE", "MAGIC_VALUE", "DEPLOY_TOKEN", "SESSION_SEED")
CODE_INTROS = (
    "Read the following Python source code. A question about it comes at the end.",
    "Below is a long Python file. Remember the value of the constant defined in it.",
)
CODE_NEEDLE = '\n{k} = "{v}"  # {k} is {v}'
CODE_QUESTIONS = (  # each ends where the code's own "NAME =" would: the model copies the value
    "\n\nQuestion: what is the value of {k} in the code above? Answer: {k} =",
    "\n\n# Question: what is {k} set to?\n# Answer: {k} =",
    "\n\n# In the code above,\n{k} =",
)


def _build_code(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    key, intro, question = rng.choice(CODE_NAMES), rng.choice(CODE_INTROS), rng.choice(CODE_QUESTIONS)
    answer = _digits(rng) if rng.random() < 0.5 else f"{rng.getrandbits(24):06x}"
    ids, starts = _layout(tokenizer, "code-needle", length, intro, [CODE_NEEDLE.format(k=key, v=answer)],
                          question.format(k=key), "code", _places(depth, 1, rng), rng)  # fmt: skip
    return Prompt(ids, answer, starts[0])


# ---- serial-needle: a UUID-like code in story sentences ----

DEVICES = ("laptop", "camera", "bicycle", "radio", "printer", "telescope")
SERIAL_NEEDLES = (
    ("The serial number of {x}'s {d} is {u}. I repeat, the serial number is {u}.",
     "What is the serial number of {x}'s {d}? The serial number is"),
    ("{x} wrote the {d}'s serial number on a card: {u}. The serial number is {u}.",
     "Which serial number did {x} write on the card? The serial number is"),
    ("The {d} that {x} bought has serial number {u}, that is {u}.",
     "What serial number does the {d} that {x} bought have? It has serial number"),
)  # fmt: skip


def _serial(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 2:
        return str(rng.randint(10**7, 10**8 - 1))
    return "-".join(f"{rng.getrandbits(16):04x}" for _ in range(kind + 2))


def _build_serial(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    needle, question = rng.choice(SERIAL_NEEDLES)
    name, device, answer = rng.choice(NAMES), rng.choice(DEVICES), _serial(rng)
    ids, starts = _layout(tokenizer, "serial-needle", length, rng.choice(PROSE_INTROS),
                          [" " + needle.format(x=name, d=device, u=answer)], "\n\n" + question.format(x=name, d=device),
                          "story", _places(depth, 1, rng), rng)  # fmt: skip
    return Prompt(ids, answer, starts[0])


# ---- question-first: the question before the document and again after ----

PETS = ("Biscuit", "Pepper", "Mochi", "Ziggy", "Clover", "Juniper", "Waffles", "Pickles", "Noodle", "Maple")
QF_FACTS: tuple[tuple[str, str, str, Callable[[random.Random], str]], ...] = (
    ("The name of {x}'s cat is {y}; the cat is called {y}.", "What is the name of {x}'s cat?",
     "The name of {x}'s cat is", lambda rng: rng.choice(PETS)),
    ("{x} stayed in hotel room {y}, room number {y}.", "In which hotel room did {x} stay?",
     "{x} stayed in hotel room", lambda rng: str(rng.randint(100, 9999))),
    ("The secret number of {x} is {y}. {x}'s secret number is {y}.", "What is the secret number of {x}?",
     "The secret number of {x} is", lambda rng: _digits(rng, 4, 7)),
)  # fmt: skip


def _build_question_first(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    fact, question, lead, answer_of = rng.choice(QF_FACTS)
    name, answer = rng.choice(NAMES), answer_of(rng)
    head = f"Answer the question using the document below.\nQuestion: {question.format(x=name)}\n\nDocument:"
    tail = f"\n\nQuestion: {question.format(x=name)}\nAnswer: {lead.format(x=name)}"
    ids, starts = _layout(tokenizer, "question-first", length, head, [" " + fact.format(x=name, y=answer)], tail,
                          "prose", _places(depth, 1, rng), rng)  # fmt: skip
    return Prompt(ids, answer, starts[0])


# ---- multi-needle-one: three coloured pass keys, one asked ----

COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black")
MULTI_ONE_NEEDLES = (
    ("The {c} pass key is {v}. Remember it. {v} is the {c} pass key.",
     "What is the {c} pass key? The {c} pass key is"),
    ("The code of the {c} door is {v}. The {c} door opens with {v}.",
     "What is the code of the {c} door? The code of the {c} door is"),
    ("Keep the {c} number in mind: {v}. The {c} number is {v}.", "What is the {c} number? The {c} number is"),
)  # fmt: skip


def _build_multi_one(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    needle, question = rng.choice(MULTI_ONE_NEEDLES)
    digits = rng.randint(4, 7)
    colours = rng.sample(COLOURS, 3)
    values = _distinct(lambda: _digits(rng, digits, digits), 3)
    needles = [" " + needle.format(c=c, v=v) for c, v in zip(colours, values, strict=True)]
    ids, starts = _layout(tokenizer, "multi-needle-one", length, prompts.INTRO, needles,
                          " " + question.format(c=colours[0]), "landmark", _places(depth, 3, rng), rng)  # fmt: skip
    return Prompt(ids, values[0], starts[0])


# ---- multi-label-one: three labelled codes in an inventory, one asked ----

# the labels' last words differ, so the words right before each value name one needle
MULTI_LABELS = ("alarm code", "safe combination", "locker number", "garage door PIN", "office extension",
                "wifi password")  # fmt: skip
MULTI_LABEL_INTROS = (
    "Below is the inventory of a shared workshop. Three of its lines hold codes; a question about one follows.",
    "Here is a long equipment list. Some lines carry codes: remember which code belongs to what.",
)
MULTI_LABEL_NEEDLE = "\n* Reminder: the {label} is {v}. Again, the {label} is {v}."
MULTI_LABEL_QUESTIONS = (
    "\n\nWhich number is the {label}? The {label} is",
    "\n\nQuestion: what is the {label}? Answer: the {label} is",
)


def _build_multi_label(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    labels, digits = rng.sample(MULTI_LABELS, 3), rng.randint(5, 7)
    values = _distinct(lambda: _digits(rng, digits, digits), 3)
    intro, question = rng.choice(MULTI_LABEL_INTROS), rng.choice(MULTI_LABEL_QUESTIONS)
    needles = [MULTI_LABEL_NEEDLE.format(label=label, v=v) for label, v in zip(labels, values, strict=True)]
    ids, starts = _layout(tokenizer, "multi-label-one", length, intro, needles, question.format(label=labels[0]),
                          "rows", _places(depth, 3, rng), rng)  # fmt: skip
    return Prompt(ids, values[0], starts[0])


# ---- log-lookup: a service log, one line with a number ----

LOG_INTROS = (
    "Below is a service log. One of its lines reports a number; a question about it follows.",
    "Here is the output of a server's log. Remember the number that appears in it.",
)
LOG_FACTS = ("recovery code", "incident number", "ticket number", "rollback token", "maintenance PIN")
LOG_NEEDLE = "\n[WARN] vault: the {label} is {v}. Repeat: the {label} is {v}."
LOG_QUESTIONS = (
    "\n\nQuestion: what is the {label} in the log above? Answer: the {label} is",
    "\n\nWhat {label} did the log report? The {label} is",
)


_build_log = _labelled_number("log-lookup", "log", LOG_INTROS, LOG_FACTS, LOG_NEEDLE, LOG_QUESTIONS, (4, 7))


# ---- chat-lookup: a group chat, one message with a number ----

CHAT_INTROS = (
    "Below is a long group chat between colleagues. Read it; a question follows.",
    "Here is the history of a team's chat. One message gives a number worth remembering.",
)
CHAT_SENDERS = ("Gwen", "Hugo", "Iris", "Jonas")  # never a sender of the haystack's messages
CHAT_FACTS = ("door code of the new office", "parking permit number", "conference room PIN", "flight number")
CHAT_NEEDLE = "\n{x}: the {label} is {v}, I repeat, {v}."
CHAT_QUESTIONS = (
    "\n\nWhat is the {label} that {x} sent? The {label} is",
    "\n\nQuestion: according to {x}, what is the {label}? Answer: the {label} is",
)


def _build_chat(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    sender, label = rng.choice(CHAT_SENDERS), rng.choice(CHAT_FACTS)
    intro, question, answer = rng.choice(CHAT_INTROS), rng.choice(CHAT_QUESTIONS), _digits(rng, 4, 7)
    needle = CHAT_NEEDLE.format(x=sender, label=label, v=answer)
    ids, starts = _layout(tokenizer, "chat-lookup", length, intro, [needle], question.format(x=sender, label=label),
                          "chat", _places(depth, 1, rng), rng)  # fmt: skip
    return Prompt(ids, answer, starts[0])


# ---- manual-lookup: an appliance manual, one sentence with a number ----

MANUAL_INTROS = (
    "Below is the user manual of a kitchen appliance. A question about it follows.",
    "Read this device manual. It mentions one number that you will be asked for.",
)
MANUAL_FACTS = ("factory reset code", "service hotline extension", "child lock PIN", "model number")
MANUAL_NEEDLE = " Important: the {label} is {v}. Write it down: {v}."
MANUAL_QUESTIONS = (
    "\n\nWhat is the {label}? The {label} is",
    "\n\nQuestion: what {label} does the manual give? Answer: the {label} is",
)

_build_manual = _labelled_number(
    "manual-lookup", "manual", MANUAL_INTROS, MANUAL_FACTS, MANUAL_NEEDLE, MANUAL_QUESTIONS, (4, 7)
)


NEW_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("word-passkey", _build_word_passkey, new_tokens=8, exact=True, split=TUNING),
        Family("list-lookup", _build_list, new_tokens=10, exact=True, split=TUNING),
        Family("code-needle", _build_code, new_tokens=10, exact=True, split=HELDOUT),
        Family("serial-needle", _build_serial, new_tokens=20, exact=True, split=HELDOUT),
        Family("question-first", _build_question_first, new_tokens=10, exact=True, split=HELDOUT),
        Family("multi-needle-one", _build_multi_one, new_tokens=10, exact=True, split=HELDOUT),
        Family("multi-label-one", _build_multi_label, new_tokens=10, exact=True, split=HELDOUT),
        Family("log-lookup", _build_log, new_tokens=10, exact=True, split=HELDOUT),
        Family("chat-lookup", _build_chat, new_tokens=10, exact=True, split=HELDOUT),
        Family("manual-lookup", _build_manual, new_tokens=10, exact=True, split=HELDOUT),
    )
}


FAMILIES: dict[str, Family] = NEW_FAMILIES  # families.py adds these to its FAMILIES


def wording_digest() -> str:
    """A hash of these families' wording tables and the code haystack (which depends on the Python version)."""
    tables = [NAMES, PROSE_INTROS, ADJECTIVES, WORDS, WORD_NEEDLES, LIST_INTROS, LIST_LABELS, LIST_NEEDLE,
              LIST_QUESTIONS, CODE_NAMES, CODE_INTROS, CODE_NEEDLE,
              CODE_QUESTIONS, DEVICES, SERIAL_NEEDLES, PETS, [f[:3] for f in QF_FACTS], COLOURS, MULTI_ONE_NEEDLES,
              MULTI_LABELS, MULTI_LABEL_INTROS, MULTI_LABEL_NEEDLE, MULTI_LABEL_QUESTIONS,
              LOG_INTROS, LOG_FACTS, LOG_NEEDLE, LOG_QUESTIONS, CHAT_INTROS, CHAT_SENDERS, CHAT_FACTS, CHAT_NEEDLE,
              CHAT_QUESTIONS, MANUAL_INTROS, MANUAL_FACTS, MANUAL_NEEDLE, MANUAL_QUESTIONS, generated_rows(50),
              generated_log(50), generated_chat(50), generated_manual(50)]  # fmt: skip
    return hashlib.sha1((json.dumps(tables) + "\n".join(code_lines())).encode()).hexdigest()[:16]
