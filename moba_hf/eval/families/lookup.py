"""Families with a labelled number among lines of a generated list, log, chat or manual, or of Python source:

family            split    context                          needle                                   answer
list-lookup       tuning   household inventory lines        "- NOTE: the alarm code is 583921. The   5-7 digits
                           (bullets, table rows)            alarm code is 583921."
code-needle       heldout  Python stdlib source lines       'SECRET_KEY = "583921"  # SECRET_KEY is  5-7 digits or
                                                            583921'                                  6 hex digits
multi-label-one   heldout  household inventory lines        3 "* Reminder: the alarm code is 583921.  5-7 digits
                                                            ..." of distinct labels; one is asked
log-lookup        heldout  service log lines, no digits     "[WARN] vault: the recovery code is      4-7 digits
                                                            30775. Repeat: ..."
chat-lookup       heldout  group chat messages, no digits   "Gwen: the conference room PIN is 7863,  4-7 digits
                                                            I repeat, 7863."
manual-lookup     heldout  appliance manual sentences,      "Important: the child lock PIN is 5468.  4-7 digits
                           no digits                        Write it down: 5468."
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from .contexts import at_depths, digits, distinct, layout, lines
from .record import HELDOUT, Family, Prompt


def _questions(text: str) -> tuple[str, ...]:
    """The question table of a family: one question a line, each asked after a blank line."""
    return tuple("\n\n" + question for question in lines(text))


def labelled_number(
    name: str,
    source: str,
    intros: Sequence[str],
    labels: Sequence[str],
    needle: str,
    questions: Sequence[str],
    n_digits: tuple[int, int],
) -> Callable[[Any, int, float, random.Random], Prompt]:
    """The builder of a family with one "the {label} is {v}" needle line in a `source` haystack: label, intro,
    question and a number of `n_digits` (low, high) drawn in that order."""

    def build(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
        label, intro, question = rng.choice(labels), rng.choice(intros), rng.choice(questions)
        answer = digits(rng, *n_digits)
        needles = [needle.format(label=label, v=answer)]
        places = at_depths(depth, 1, rng)
        ids, starts = layout(tokenizer, name, length, intro, needles, question.format(label=label), source, places, rng)
        return Prompt(ids, answer, starts[0])

    return build


LIST_INTROS = lines("""
    Below is a household inventory list. One line of it holds a number; a question about it follows.
    Here is a long list of things in a house and where they are kept. Remember the number in it.
""")
LIST_LABELS = ("alarm code", "safe combination", "storage unit number", "bike lock code", "locker number")
LIST_NEEDLE = "\n- NOTE: the {label} is {v}. The {label} is {v}."
LIST_QUESTIONS = _questions("""
    What is the {label}? The {label} is
    Question: what is the {label} in the list? Answer: the {label} is
    Look at the list above. The {label} is
""")
_build_list = labelled_number("list-lookup", "rows", LIST_INTROS, LIST_LABELS, LIST_NEEDLE, LIST_QUESTIONS, (5, 7))

CODE_NAMES = ("SECRET_KEY", "BUILD_NUMBER", "LICENSE_CODE", "MAGIC_VALUE", "DEPLOY_TOKEN", "SESSION_SEED")
CODE_INTROS = lines("""
    Read the following Python source code. A question about it comes at the end.
    Below is a long Python file. Remember the value of the constant defined in it.
""")
CODE_NEEDLE = '\n{k} = "{v}"  # {k} is {v}'
CODE_QUESTIONS = (  # each ends where the code's own "NAME =" would: the model copies the value
    "\n\nQuestion: what is the value of {k} in the code above? Answer: {k} =",
    "\n\n# Question: what is {k} set to?\n# Answer: {k} =",
    "\n\n# In the code above,\n{k} =",
)


def _build_code(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    key, intro, question = rng.choice(CODE_NAMES), rng.choice(CODE_INTROS), rng.choice(CODE_QUESTIONS)
    answer = digits(rng) if rng.random() < 0.5 else f"{rng.getrandbits(24):06x}"
    needles = [CODE_NEEDLE.format(k=key, v=answer)]
    places = at_depths(depth, 1, rng)
    ids, starts = layout(tokenizer, "code-needle", length, intro, needles, question.format(k=key), "code", places, rng)
    return Prompt(ids, answer, starts[0])


# the labels' last words differ, so the words right before each value name one needle
MULTI_LABELS = (
    "alarm code",
    "safe combination",
    "locker number",
    "garage door PIN",
    "office extension",
    "wifi password",
)
MULTI_LABEL_INTROS = lines("""
    Below is the inventory of a shared workshop. Three of its lines hold codes; a question about one follows.
    Here is a long equipment list. Some lines carry codes: remember which code belongs to what.
""")
MULTI_LABEL_NEEDLE = "\n* Reminder: the {label} is {v}. Again, the {label} is {v}."
MULTI_LABEL_QUESTIONS = _questions("""
    Which number is the {label}? The {label} is
    Question: what is the {label}? Answer: the {label} is
""")


def _build_labels(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    labels, n_digits = rng.sample(MULTI_LABELS, 3), rng.randint(5, 7)
    values = distinct(lambda: digits(rng, n_digits, n_digits), 3)
    intro, question = rng.choice(MULTI_LABEL_INTROS), rng.choice(MULTI_LABEL_QUESTIONS)
    needles = [MULTI_LABEL_NEEDLE.format(label=label, v=v) for label, v in zip(labels, values, strict=True)]
    tail, places = question.format(label=labels[0]), at_depths(depth, 3, rng)
    ids, starts = layout(tokenizer, "multi-label-one", length, intro, needles, tail, "rows", places, rng)
    return Prompt(ids, values[0], starts[0])


LOG_INTROS = lines("""
    Below is a service log. One of its lines reports a number; a question about it follows.
    Here is the output of a server's log. Remember the number that appears in it.
""")
LOG_FACTS = ("recovery code", "incident number", "ticket number", "rollback token", "maintenance PIN")
LOG_NEEDLE = "\n[WARN] vault: the {label} is {v}. Repeat: the {label} is {v}."
LOG_QUESTIONS = _questions("""
    Question: what is the {label} in the log above? Answer: the {label} is
    What {label} did the log report? The {label} is
""")
_build_log = labelled_number("log-lookup", "log", LOG_INTROS, LOG_FACTS, LOG_NEEDLE, LOG_QUESTIONS, (4, 7))

CHAT_INTROS = lines("""
    Below is a long group chat between colleagues. Read it; a question follows.
    Here is the history of a team's chat. One message gives a number worth remembering.
""")
CHAT_SENDERS = ("Gwen", "Hugo", "Iris", "Jonas")  # never a sender of the haystack's messages
CHAT_FACTS = ("door code of the new office", "parking permit number", "conference room PIN", "flight number")
CHAT_NEEDLE = "\n{x}: the {label} is {v}, I repeat, {v}."
CHAT_QUESTIONS = _questions("""
    What is the {label} that {x} sent? The {label} is
    Question: according to {x}, what is the {label}? Answer: the {label} is
""")


def _build_chat(tokenizer: Any, length: int, depth: float, rng: random.Random) -> Prompt:
    sender, label = rng.choice(CHAT_SENDERS), rng.choice(CHAT_FACTS)
    intro, question, answer = rng.choice(CHAT_INTROS), rng.choice(CHAT_QUESTIONS), digits(rng, 4, 7)
    needles = [CHAT_NEEDLE.format(x=sender, label=label, v=answer)]
    tail, places = question.format(x=sender, label=label), at_depths(depth, 1, rng)
    ids, starts = layout(tokenizer, "chat-lookup", length, intro, needles, tail, "chat", places, rng)
    return Prompt(ids, answer, starts[0])


MANUAL_INTROS = lines("""
    Below is the user manual of a kitchen appliance. A question about it follows.
    Read this device manual. It mentions one number that you will be asked for.
""")
MANUAL_FACTS = ("factory reset code", "service hotline extension", "child lock PIN", "model number")
MANUAL_NEEDLE = " Important: the {label} is {v}. Write it down: {v}."
MANUAL_QUESTIONS = _questions("""
    What is the {label}? The {label} is
    Question: what {label} does the manual give? Answer: the {label} is
""")
_build_manual = labelled_number(
    "manual-lookup", "manual", MANUAL_INTROS, MANUAL_FACTS, MANUAL_NEEDLE, MANUAL_QUESTIONS, (4, 7)
)


FAMILIES = (
    Family("list-lookup", _build_list, about="a code in a household inventory list"),
    Family("code-needle", _build_code, split=HELDOUT, about="a constant's value in Python source"),
    Family("multi-label-one", _build_labels, split=HELDOUT, about="one of three labelled codes in an inventory list"),
    Family("log-lookup", _build_log, split=HELDOUT, about="a number in a service log"),
    Family("chat-lookup", _build_chat, split=HELDOUT, about="a number in a group chat"),
    Family("manual-lookup", _build_manual, split=HELDOUT, about="a number in an appliance manual"),
)
