"""Prompt families: one retrieval question (find a fact hidden in a long context and say it) asked over
different kinds of text, so that a setting is judged on its worst family rather than on one prompt's quirks.

    record.py     Prompt, Family: name, builder, answer tokens, split, description, scorer
    contexts.py   the shared word tables, the token ids of every context source (one cache), the prompt layout
    landmark.py   passkey, word-passkey, multi-needle-one (the Landmark passkey filler)
    prose.py      prose-needle, question-first (Python's documentation)
    story.py      kv-retrieval, serial-needle (generated story sentences)
    lookup.py     list-lookup, code-needle, multi-label-one, log-lookup, chat-lookup, manual-lookup (a labelled
                  number among lines of a list, Python source, a log, a chat or a manual)

    [special tokens] [intro] [context ... NEEDLE ... context] [question]   -> greedy continuation, scored

Each family has a split: "tuning" (a preset may be chosen on it) or "heldout" (reported only, never used to
choose); every family was chosen as one that dense attention on the embedded SmolLM2-135M-Instruct answers, so
that a sparse setting's loss shows. `ALL`, the sweep's default, is passkey, prose-needle and kv-retrieval.

Every trial draws the intro, needle wording, question, answer format and answer from
random.Random(f"{family}:{seed}:{length}:{depth}:{trial}"): every setting sees the same prompts (a paired
comparison), and so does every re-run.

Length (special tokens included): prompts are exactly `length` tokens (the context is cut at a token, so its
last unit may end early), except passkey's, which hold whole filler sentences (prompts.py's builder): `length`
tokens or fewer, by less than one filler (under 32 tokens).
Depth: the (asked) needle goes at the context unit boundary (sentence, filler sentence or line) nearest
depth x the context's tokens (passkey: after round(depth * n) of the n fillers): 0 is right after the intro, 1
right before the question; the other needles of kv-retrieval, multi-needle-one and multi-label-one sit at drawn
depths.
Scoring (all families): `scoring.score_words`, the continuation's first words must be every word of the answer
(all digits of a code, every hex group).

Tried and left out, dense 0/5 at 4096 tokens: all of 2-3 numbered pass keys in Landmark filler (the model
repeats the first key or starts a list), and a RULER-style chain "VAR QXK = 48213. ... VAR BRT = VAR QXK."
asked for the last name's value (it answers a variable name).

A new family: a builder and a `Family(...)` entry in the module of its kind of context (or a new module here,
added to `_MODULES`), its wording tables in `other_wording_digest`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from ... import prompts
from ..texts import code_lines, generated_chat, generated_log, generated_manual, generated_rows, prose_digest
from . import contexts, landmark, lookup, prose, story
from .record import HELDOUT, SPLIT_NAMES, TUNING, Family, Prompt

__all__ = [
    "ALL",
    "FAMILIES",
    "HELDOUT",
    "SPLITS",
    "SPLIT_NAMES",
    "TUNING",
    "Family",
    "Prompt",
    "by_split",
    "check_fits",
    "other_wording_digest",
    "parse_families",
    "text_params",
    "wording_digest",
]

ALL = ("passkey", "prose-needle", "kv-retrieval")  # the default, first in the registry
_MODULES = (landmark, prose, story, lookup)
_RECORDS = {f.name: f for module in _MODULES for f in module.FAMILIES}
FAMILIES: dict[str, Family] = {name: _RECORDS[name] for name in [*ALL, *(n for n in _RECORDS if n not in ALL)]}
SPLITS: dict[str, str] = {name: f.split for name, f in FAMILIES.items()}


def parse_families(spec: str | Sequence[str] | None) -> list[str]:
    """'passkey,kv-retrieval' (or a list) -> known family names, in the given order, without repeats."""
    if spec is None:
        return list(ALL)
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if not names or unknown:
        listed = f" (unknown: {', '.join(unknown)})" if unknown else ""
        raise ValueError(f"families must be names among {', '.join(FAMILIES)}, got {spec!r}{listed}")
    return list(dict.fromkeys(names))


def by_split() -> dict[str, list[str]]:
    """{"tuning": [names], "heldout": [names]}, in registry order: the layout of the `--families` help."""
    return {split: [name for name, f in FAMILIES.items() if f.split == split] for split in SPLIT_NAMES}


def check_fits(tokenizer: Any, families: Sequence[str], lengths: Sequence[int]) -> None:
    """Every length must hold every family's prompt (raises ValueError naming the family and the minimum)."""
    for name in families:
        shortest = FAMILIES[name].min_length(tokenizer)
        if min(lengths) < shortest:
            raise ValueError(f"lengths must be >= {shortest} tokens to hold the {name} prompt, got {min(lengths)}")


def _sha1(tables: list[Any], extra: str = "") -> str:
    return hashlib.sha1((json.dumps(tables) + extra).encode()).hexdigest()[:16]


def wording_digest() -> str:
    """A hash of the wording tables of passkey, prose-needle and kv-retrieval: a resume after they change is
    refused, not mixed."""
    return _sha1(
        [
            prompts.INTRO,
            prompts.FILLER,
            prompts.WORDINGS,
            contexts.NAMES,
            prose.CITIES,
            prose.SPICES,
            contexts.ADJECTIVES,
            contexts.NOUNS,
            prose.PLACES,
            [needle[:2] for needle in prose.PROSE_NEEDLES],
            contexts.PROSE_INTROS,
            story.KV_NEEDLES,
            story.N_NEEDLES,
        ]
    )


def other_wording_digest() -> str:
    """A hash of the other ten families' wording tables and haystacks (the code haystack depends on the Python
    version)."""
    tables = [contexts.NAMES, contexts.PROSE_INTROS, contexts.ADJECTIVES, landmark.WORDS, landmark.WORD_NEEDLES]
    tables += [lookup.LIST_INTROS, lookup.LIST_LABELS, lookup.LIST_NEEDLE, lookup.LIST_QUESTIONS]
    tables += [lookup.CODE_NAMES, lookup.CODE_INTROS, lookup.CODE_NEEDLE, lookup.CODE_QUESTIONS]
    tables += [story.DEVICES, story.SERIAL_NEEDLES, prose.PETS, [fact[:3] for fact in prose.QF_FACTS]]
    tables += [landmark.COLOURS, landmark.MULTI_ONE_NEEDLES]
    tables += [lookup.MULTI_LABELS, lookup.MULTI_LABEL_INTROS, lookup.MULTI_LABEL_NEEDLE, lookup.MULTI_LABEL_QUESTIONS]
    tables += [lookup.LOG_INTROS, lookup.LOG_FACTS, lookup.LOG_NEEDLE, lookup.LOG_QUESTIONS]
    tables += [lookup.CHAT_INTROS, lookup.CHAT_SENDERS, lookup.CHAT_FACTS, lookup.CHAT_NEEDLE, lookup.CHAT_QUESTIONS]
    tables += [lookup.MANUAL_INTROS, lookup.MANUAL_FACTS, lookup.MANUAL_NEEDLE, lookup.MANUAL_QUESTIONS]
    tables += [generated_rows(50), generated_log(50), generated_chat(50), generated_manual(50)]
    return _sha1(tables, "\n".join(code_lines()))


def text_params(families: Sequence[str]) -> dict[str, Any]:
    """Run parameters that pin the families' texts: their wordings and the prose (which depends on the
    Python version)."""
    params = {"wording_sha1": wording_digest()}
    if {"prose-needle", "question-first"} & set(families):
        params["prose_sha1"] = prose_digest()
    if set(families) - set(ALL):
        params["heldout_wording_sha1"] = other_wording_digest()  # the run.json key of the other ten's tables
    return params
