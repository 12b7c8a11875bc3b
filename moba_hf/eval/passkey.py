"""Passkey retrieval with the Landmark-attention prompt (Mohtashami & Jaggi, 2023).

    <intro> <filler x a> The pass key is N. Remember it. N is the pass key. <filler x b>
    What is the pass key? The pass key is

The prompt is sized in tokens of the model's tokenizer; `depth` in [0, 1] places the passkey line.
Scoring: the first integer in the generated continuation must equal N.
"""

from __future__ import annotations

import dataclasses
import random
import re
import time
from typing import Any

import torch

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key? The pass key is"


def passkey_line(passkey: int) -> str:
    return f"The pass key is {passkey}. Remember it. {passkey} is the pass key."


def build_prompt(tokenizer: Any, length: int, depth: float, passkey: int) -> str:
    """A prompt of about `length` tokens (never more) with the passkey line at fractional `depth`."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")

    def n_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    fixed = n_tokens(" ".join([INTRO, passkey_line(passkey), QUESTION]))
    per_filler = n_tokens(" ".join([FILLER] * 20)) / 20
    n_filler = max(0, int((length - fixed) / per_filler))
    while n_filler > 0 and n_tokens(_assemble(n_filler, depth, passkey)) > length:
        n_filler -= 1
    return _assemble(n_filler, depth, passkey)


def _assemble(n_filler: int, depth: float, passkey: int) -> str:
    before = round(n_filler * depth)
    parts = [INTRO, *[FILLER] * before, passkey_line(passkey), *[FILLER] * (n_filler - before), QUESTION]
    return " ".join(parts)


def first_integer(text: str) -> int | None:
    match = re.search(r"\d+", text)
    return int(match.group()) if match else None


def random_passkey(rng: random.Random) -> int:
    return rng.randint(10000, 99999)


@dataclasses.dataclass
class PasskeyTrial:
    length: int
    depth: float
    expected: int
    got: int | None
    correct: bool
    prompt_tokens: int
    prefill_seconds: float
    output: str


@torch.no_grad()
def run_trial(model: Any, tokenizer: Any, length: int, depth: float, passkey: int, max_new_tokens: int = 8) -> PasskeyTrial:
    """One passkey trial: greedy decoding; the prefill (first forward) is timed separately."""
    prompt = build_prompt(tokenizer, length, depth, passkey)
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    start = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    prefill = time.perf_counter() - start
    cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
    next_token = out.logits[:, -1:].argmax(-1)
    generated = [next_token]
    for _ in range(max_new_tokens - 1):
        step = model(input_ids=next_token, past_key_values=cache, use_cache=True)
        cache = step.past_key_values if hasattr(step, "past_key_values") else step.cache
        next_token = step.logits[:, -1:].argmax(-1)
        generated.append(next_token)
    text = tokenizer.decode(torch.cat(generated, dim=-1)[0], skip_special_tokens=True)
    got = first_integer(text)
    return PasskeyTrial(length, depth, passkey, got, got == passkey, ids.shape[1], prefill, text)
