"""The passkey prompt (Landmark Attention's wording and filler), shared by the passkey eval, the prompt families
(eval/) and the synthetic training documents (train/): one text, so a passkey eval after training is in the
training format. Plain text and a tokenizer; no torch, no model.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key? The pass key is"
# (key line with {key}, question): wording 0 is Landmark's, the prompt of `eval passkey`; the `passkey` prompt
# family (eval/families) draws one per trial. 1-3 are not among the training mixture's wordings (train/synthetic.py).
WORDINGS = (
    ("The pass key is {key}. Remember it. {key} is the pass key.", QUESTION),
    (
        "Write down the vault combination: {key}. The vault combination is {key}.",
        "What is the vault combination? The vault combination is",
    ),
    (
        "Here is the number to remember, {key}. Again, the number to remember is {key}.",
        "What is the number to remember? The number to remember is",
    ),
    (
        "The door code of the archive is {key}. {key} opens the archive door.",
        "What is the door code of the archive? The door code of the archive is",
    ),
)


def passkey_line(passkey: int, wording: int = 0) -> str:
    return WORDINGS[wording][0].format(key=passkey)


def build_prompt(tokenizer: Any, length: int, depth: float, passkey: int, *, wording: int = 0) -> str:
    """A prompt of `length` tokens or fewer (by less than one filler, about 20 tokens) with the passkey line
    after round(depth * fillers) of the filler sentences; `wording` indexes WORDINGS."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if not 0 <= wording < len(WORDINGS):
        raise ValueError(f"wording must be in [0, {len(WORDINGS) - 1}], got {wording}")

    def n_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    fixed = n_tokens(_assemble(0, depth, passkey, wording))
    per_filler = n_tokens(" ".join([FILLER] * 20)) / 20
    n_filler = max(0, int((length - fixed) / per_filler))
    while n_filler > 0 and n_tokens(_assemble(n_filler, depth, passkey, wording)) > length:
        n_filler -= 1
    return _assemble(n_filler, depth, passkey, wording)


def _assemble(n_filler: int, depth: float, passkey: int, wording: int = 0) -> str:
    before = round(n_filler * depth)
    line, question = passkey_line(passkey, wording), WORDINGS[wording][1]
    parts = [INTRO, *[FILLER] * before, line, *[FILLER] * (n_filler - before), question]
    return " ".join(parts)


def min_length(tokenizer: Any) -> int:
    """Tokens of the prompt without filler: shorter lengths cannot hold the passkey prompt."""
    return len(tokenizer(_assemble(0, 0.5, 99999)).input_ids)


def random_passkey(rng: random.Random) -> int:
    return rng.randint(10000, 99999)


def encode(tokenizer: Any, text: str, device: Any) -> torch.Tensor:
    """`text` as a [1, n] tensor of token ids (the tokenizer's special tokens included) on `device`."""
    return tokenizer(text, return_tensors="pt").input_ids.to(device)
