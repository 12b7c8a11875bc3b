"""Needle in a haystack: one needle sentence hidden at fractional `depth` of a haystack, then a question.

    <haystack sentences ... NEEDLE ... haystack sentences>\\n\\n<QUESTION>

The prompt is at most `length` tokens of the model's tokenizer; the needle goes between sentences. A
`{answer}` placeholder in needle / question is filled per trial with a random 7-digit number (the same for
every setting); without it the fixed `answer` is expected. Scoring: numbers by exact match of the first
integer, text by case- and space-insensitive containment (`scoring.score_niah`).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..prompts import encode
from .decoding import greedy_decode
from .grid import EvalResult, check_grid, depth_grid_eval, window_warnings
from .scoring import score_niah
from .settings import SettingLike, resolve_settings
from .texts import generated_text

NEEDLE = "The secret code for the blue door is {answer}."
QUESTION = "What is the secret code for the blue door? The secret code for the blue door is"

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def trial_answer(seed: int, length: int, depth: float, index: int) -> str:
    return str(random.Random(f"niah:{seed}:{length}:{depth}:{index}").randint(1_000_000, 9_999_999))


class Haystack:
    """Sentences of the source texts with their token counts; repeats them when a prompt needs more."""

    def __init__(self, tokenizer: Any, texts: Sequence[str]):
        self.tokenizer = tokenizer
        self.sentences = [s for text in texts for s in _SENTENCE_END.split(text.strip()) if s.strip()]
        if not self.sentences:
            raise ValueError("the haystack holds no text")
        # standalone counts: the joining space usually merges into the next token; prompt() trims any excess
        self.counts = [len(c) for c in tokenizer(self.sentences, add_special_tokens=False).input_ids]

    def digest(self) -> str:
        return hashlib.sha1("\n".join(self.sentences).encode()).hexdigest()[:16]

    def n_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _take(self, budget: int) -> list[str]:
        taken, used, i = [], 0, 0
        while used + self.counts[i % len(self.counts)] <= budget:
            used += self.counts[i % len(self.counts)]
            taken.append(self.sentences[i % len(self.sentences)])
            i += 1
        return taken

    def prompt(self, length: int, depth: float, needle: str, question: str) -> str:
        """A prompt of at most `length` tokens with `needle` after a fraction `depth` of the haystack sentences."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        fixed = self.n_tokens(f"{needle}\n\n{question}") + 1
        if fixed >= length:
            raise ValueError(f"length={length} leaves no room for a haystack around needle + question ({fixed} tokens)")
        sentences = self._take(length - fixed)
        while True:
            at = round(len(sentences) * depth)
            text = " ".join([*sentences[:at], needle, *sentences[at:]]) + "\n\n" + question
            if not sentences or self.n_tokens(text) <= length:
                return text
            sentences = sentences[:-1]


def check_fits(hay: Haystack, lengths: Sequence[int], needle: str, question: str) -> None:
    """Every length must leave room for some haystack around the needle and the question."""
    sample = needle.replace("{answer}", "1234567"), question.replace("{answer}", "1234567")
    fixed = hay.n_tokens(f"{sample[0]}\n\n{sample[1]}") + 1
    if min(lengths) <= fixed:
        raise ValueError(f"lengths must be > {fixed} tokens to hold needle + question, got {min(lengths)}")


def niah_eval(
    model: Any,
    tokenizer: Any,
    settings: Sequence[SettingLike] | None = None,
    lengths: Sequence[int] = (1024, 2048),
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    trials: int = 2,
    out_dir: str | Path = "runs/niah",
    *,
    haystack: Sequence[str] | None = None,
    needle: str = NEEDLE,
    question: str = QUESTION,
    answer: str | None = None,
    seed: int = 0,
    max_new_tokens: int = 12,
    model_name: str | None = None,
    progress: bool = True,
    track: bool = True,
    allow_changed: bool = False,
) -> EvalResult:
    """Needle-in-a-haystack accuracy per setting on the lengths x depths grid, with a heatmap PNG.

    haystack: documents (see `moba_hf.eval.texts.load_texts`); default: generated offline text. Resume and the
    window check as in `passkey.passkey_eval`.
    """
    settings = resolve_settings(settings)
    lengths, depths = check_grid(lengths, depths, trials)
    templated = "{answer}" in needle or "{answer}" in question
    if not templated and not answer:
        raise ValueError(f"needle {needle!r} has no {{answer}} placeholder, so answer= must give the expected text")
    texts = list(haystack) if haystack is not None else [generated_text(max(lengths) + 2000, seed)]
    hay = Haystack(tokenizer, texts)
    check_fits(hay, lengths, needle, question)
    params = {"lengths": lengths, "depths": depths, "trials": trials, "seed": seed, "max_new_tokens": max_new_tokens}
    params.update(needle=needle, question=question, answer=answer, haystack_sha1=hay.digest())
    warnings = window_warnings(model, settings, lengths, max_new_tokens)
    prompts: dict[tuple, tuple[torch.Tensor, str]] = {}

    def run_cell(cell: dict[str, Any]) -> dict[str, Any]:
        key = (cell["length"], cell["depth"], cell["trial"])
        if key not in prompts:
            expected = trial_answer(seed, *key) if templated else str(answer)
            fill = needle.replace("{answer}", expected), question.replace("{answer}", expected)
            text = hay.prompt(key[0], key[1], *fill)
            prompts[key] = (encode(tokenizer, text, model.device), expected)
        ids, expected = prompts[key]
        decoded = greedy_decode(model, ids, max_new_tokens, track=track, eos_token_id=tokenizer.eos_token_id)
        output = tokenizer.decode(decoded.tokens, skip_special_tokens=True)
        return {
            "expected": expected,
            "got": output.strip(),
            "correct": score_niah(expected, output),
            "prompt_tokens": ids.shape[1],
            **decoded.measurements(),
        }

    common = {"model_name": model_name, "progress": progress, "allow_changed": allow_changed, "warnings": warnings}
    grid = (lengths, depths, trials)
    return depth_grid_eval(model, settings, run_cell, grid, out_dir, "niah", "needle in a haystack", params, **common)
