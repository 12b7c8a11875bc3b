"""How every evaluation scores a greedy continuation against the expected answer: one module, three rules.

rule           used by              correct when
score_words    the prompt families  the continuation's first words are the answer's words, compared lower-cased
                                    with punctuation and whitespace runs read as one space ("  Oslo." matches
                                    "oslo"; "12345" does not match "1234")
score_passkey  passkey              the first integer of the continuation equals the passkey
score_niah     niah                 a number: the first integer equals it; text: it appears in the continuation
                                    (case-, space- and punctuation-blind)
"""

from __future__ import annotations

import re


def words(text: str) -> list[str]:
    """Lower-cased runs of letters and digits: the units `score_words` compares."""
    return re.sub(r"[^0-9a-z]+", " ", str(text).lower()).split()


def first_integer(text: str) -> int | None:
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


def score_words(expected: str, output: str) -> tuple[str | None, bool]:
    """(the continuation's first words, as many as the answer has; whether they are the answer's words)."""
    want = words(expected)
    got = words(output)[: len(want)]
    return " ".join(got) or None, bool(want) and got == want


def score_passkey(expected: int, output: str) -> tuple[int | None, bool]:
    """(the first integer of `output`; whether it is `expected`)."""
    got = first_integer(output)
    return got, got == expected


def _normalize(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def score_niah(expected: str, output: str) -> bool:
    """A number must be the first integer of `output`; text must appear in it (case/space/punctuation-blind)."""
    expected = str(expected).strip()
    if re.fullmatch(r"\d+", expected):
        return first_integer(output) == int(expected)
    return bool(_normalize(expected)) and _normalize(expected) in _normalize(output)
