"""Synthetic long-context retrieval documents (passkey style) for activating MoBA by continued training.

Each document hides one key line at a random depth in filler text and ends with the question and its
answer; by default only the answer is trained on, so every unit of loss needs long-range retrieval:

    <intro> <filler ...> The pass key is 48213. Remember it. 48213 is the pass key. <filler ...>
    What is the pass key? The pass key is| 48213.|     <- loss only here (loss_on="answer")

The mixture varies the filler and the key wording; template 0 with filler 0 is exactly the prompt of
`moba_hf.eval.passkey` (both from `moba_hf.prompts`), so a passkey eval after training is in-distribution for
the format (report it so), while the keys, depths and lengths are drawn from a different random stream than the
eval's.
"""

from __future__ import annotations

import random
from typing import Any

from ..prompts import FILLER, INTRO, QUESTION, random_passkey
from .data import IGNORE, Document

FILLERS = (
    FILLER,
    "The river runs to the sea. Birds fly south in winter. Leaves fall in autumn. Life goes on.",
    "A cat sleeps on the warm mat. The kettle hums in the kitchen. Rain taps on the window again.",
    "Trains leave the station at noon. The market opens early. People walk along the quiet street.",
)
# (key line with {key}, question); template 0 is the passkey eval's wording
TEMPLATES = (
    ("The pass key is {key}. Remember it. {key} is the pass key.", QUESTION),  # == passkey_line(key), tested
    (
        "The secret number is {key}. Keep it in mind. {key} is the secret number.",
        "What is the secret number? The secret number is",
    ),
    (
        "The access code is {key}. Do not forget it. {key} is the access code.",
        "What is the access code? The access code is",
    ),
)
LOSS_ON = ("answer", "all")


def retrieval_document(
    tokenizer: Any, length: int, depth: float, key: int, *, template: int = 0, filler: int = 0, loss_on: str = "answer"
) -> Document:
    """One document of at most `length` tokens (question and answer included)."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on must be one of {LOSS_ON}, got {loss_on!r}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    key_line, question = TEMPLATES[template]
    key_line = key_line.format(key=key)
    answer = tokenizer(f" {key}.", add_special_tokens=False).input_ids
    sentence = FILLERS[filler]

    def prompt_ids(n_filler: int) -> list[int]:
        before = round(n_filler * depth)
        parts = [INTRO, *[sentence] * before, key_line, *[sentence] * (n_filler - before), question]
        return tokenizer(" ".join(parts)).input_ids  # special tokens as the passkey eval tokenizes its prompt

    budget = length - len(answer)
    per_filler = len(tokenizer(" ".join([sentence] * 10), add_special_tokens=False).input_ids) / 10
    n_filler = max(0, int((budget - len(prompt_ids(0))) / per_filler))
    ids = prompt_ids(n_filler)
    while n_filler > 0 and len(ids) > budget:
        n_filler -= 1
        ids = prompt_ids(n_filler)
    labels = list(ids) if loss_on == "all" else [IGNORE] * len(ids)
    return Document(ids + answer, labels + answer)


def retrieval_mixture(
    tokenizer: Any,
    num_documents: int,
    *,
    min_length: int,
    max_length: int,
    seed: int = 0,
    loss_on: str = "answer",
    eval_format_only: bool = False,
) -> list[Document]:
    """`num_documents` documents with lengths in [min_length, max_length], random depths, keys and wording."""
    if not 1 <= min_length <= max_length:
        raise ValueError(f"need 1 <= min_length <= max_length, got min_length={min_length}, max_length={max_length}")
    if num_documents < 1:
        raise ValueError(f"num_documents must be >= 1, got {num_documents}")
    rng = random.Random(f"moba_hf.train.synthetic:{seed}")  # a stream apart from the passkey eval's
    docs = []
    for _ in range(num_documents):
        template = 0 if eval_format_only else rng.randrange(len(TEMPLATES))
        filler = 0 if eval_format_only else rng.randrange(len(FILLERS))
        docs.append(
            retrieval_document(
                tokenizer,
                rng.randint(min_length, max_length),
                rng.random(),
                random_passkey(rng),
                template=template,
                filler=filler,
                loss_on=loss_on,
            )
        )
    return docs
