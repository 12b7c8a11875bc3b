"""Perplexity of long documents at several context lengths.

mode "first":   the first L tokens of each document long enough (L - 1 predictions per document); the
                classic "perplexity vs context length" curve.
mode "sliding": the first `max_tokens` tokens of each document, scored by windows of L tokens moved by
                `stride` (default L / 2, at most L - 1); each token is scored once, by the first window that
                reaches it, so every length scores the same tokens:

                tokens   0 ........................................ max_tokens
                window 1 [=============== L ===============]
                window 2                 [··· context ····][== scored ==]
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..integration import track_sparsity
from .decoding import sync_device
from .grid import EvalResult, open_store, run_grid, window_warnings
from .report import line_plot, summary_table
from .settings import SettingLike, resolve_settings
from .texts import generated_text

MODES = ("first", "sliding")
_LOGIT_CHUNK = 1024  # positions per lm_head chunk: [chunk, vocab] floats instead of [L, vocab]


def windows(n_tokens: int, length: int, mode: str, stride: int | None = None) -> list[tuple[int, int, int]]:
    """(begin, end, score_from): feed tokens [begin, end), score the tokens at [score_from, end)."""
    if mode == "first":
        return [(0, length, 1)] if n_tokens >= length else []
    stride = stride or max(1, length // 2)
    if not 1 <= stride < length:
        raise ValueError(f"stride must be in [1, length - 1 = {length - 1}], got {stride}")
    if n_tokens < 2:
        return []
    out = [(0, min(length, n_tokens), 1)]
    while out[-1][1] < n_tokens:
        scored_to = out[-1][1]
        end = min(scored_to + stride, n_tokens)
        out.append((max(0, end - length), end, scored_to))  # at least length - stride tokens of context
    return out


def _direct_head(model: Any) -> bool:
    """True when logits are plain lm_head(hidden) (so they can be computed in chunks)."""
    config = model.config
    scales = ("final_logit_softcapping", "logit_scale", "logits_scaling")
    scaled = any(getattr(config, a, None) not in (None, 1, 1.0) for a in scales)
    return not scaled and hasattr(model, "get_decoder") and model.get_output_embeddings() is not None


@torch.no_grad()
def window_nll(model: Any, ids: torch.Tensor, score_from: int, *, track: bool = True) -> dict[str, Any]:
    """Summed negative log-likelihood of ids[0, score_from:] given what precedes them in `ids` [1, L]."""
    if not 1 <= score_from < ids.shape[1]:
        raise ValueError(f"score_from must be in [1, {ids.shape[1] - 1}], got {score_from}")
    direct = _direct_head(model)
    with track_sparsity() if track else contextlib.nullcontext() as stats:
        sync_device(ids.device)
        start = time.perf_counter()
        if direct:
            hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]
        else:
            logits = model(input_ids=ids, use_cache=False).logits[0]
        sync_device(ids.device)
        seconds = time.perf_counter() - start
    targets = ids[0, score_from:]
    nll = 0.0
    head = model.get_output_embeddings()
    for s in range(score_from - 1, ids.shape[1] - 1, _LOGIT_CHUNK):
        e = min(s + _LOGIT_CHUNK, ids.shape[1] - 1)
        chunk = head(hidden[s:e]) if direct else logits[s:e]
        nll += float(F.cross_entropy(chunk.float(), targets[s - score_from + 1 : e - score_from + 1], reduction="sum"))
    tracked = stats is not None and stats.layers
    return {
        "nll_sum": nll,
        "tokens_scored": int(targets.numel()),
        "prefill_seconds": seconds,
        "sparsity": (stats.overall if tracked else 0.0) if track else None,
        "sparsity_per_layer": stats.per_layer() if tracked else {},
    }


def check_documents(tokenizer: Any, documents: Sequence[str], lengths: Sequence[int]) -> None:
    """Some document must reach every length (a shorter one would be scored at another length)."""
    longest = max(len(tokenizer(d).input_ids) for d in documents)
    if longest < max(lengths):
        raise ValueError(
            f"the longest document has {longest} tokens, shorter than the asked length {max(lengths)}: "
            "give longer text or shorter lengths"
        )


def ppl_eval(
    model: Any,
    tokenizer: Any,
    settings: Sequence[SettingLike] | None = None,
    lengths: Sequence[int] = (512, 1024, 2048),
    out_dir: str | Path = "runs/ppl",
    *,
    documents: Sequence[str] | None = None,
    mode: str = "first",
    stride: int | None = None,
    max_tokens: int | None = None,
    max_docs: int | None = None,
    model_name: str | None = None,
    progress: bool = True,
    track: bool = True,
    allow_changed: bool = False,
) -> EvalResult:
    """Perplexity per setting and context length (see the module docstring for the modes), with a line plot.

    documents: texts (see `moba_hf.eval.texts.load_texts`); default: generated offline text, which only
    makes sense for comparing settings, not as an absolute perplexity. Resume and the window check as in
    `passkey.passkey_eval`.
    """
    settings = resolve_settings(settings)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    lengths = sorted({int(n) for n in lengths})
    if not lengths or lengths[0] < 2:
        raise ValueError(f"lengths must be a non-empty list of token counts >= 2, got {lengths}")
    max_tokens = max_tokens or lengths[-1]
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    texts = list(documents) if documents is not None else [generated_text(lengths[-1] + 1000)]
    texts = texts[:max_docs] if max_docs else texts
    docs = [tokenizer(t, return_tensors="pt").input_ids for t in texts]
    if mode == "sliding":
        docs = [d[:, :max_tokens] for d in docs]
    plan = {(n, i): windows(d.shape[1], n, mode, stride) for n in lengths for i, d in enumerate(docs)}
    longest = max(d.shape[1] for d in docs)
    if mode == "first" and longest < lengths[-1] or mode == "sliding" and longest < min(lengths[-1], max_tokens):
        raise ValueError(f"the longest document has {longest} tokens, shorter than the asked length {lengths[-1]}")
    params = {
        "lengths": lengths,
        "mode": mode,
        "stride": stride,
        "max_tokens": max_tokens if mode == "sliding" else None,
    }
    params.update(documents=len(docs), document_tokens=[d.shape[1] for d in docs])
    warnings = window_warnings(model, settings, lengths)

    def run_cell(cell: dict[str, Any]) -> dict[str, Any]:
        begin, end, score_from = plan[(cell["length"], cell["doc"])][cell["window"]]
        ids = docs[cell["doc"]][:, begin:end].to(model.device)
        return {"prompt_tokens": end - begin, **window_nll(model, ids, score_from - begin, track=track)}

    cells = [{"length": n, "doc": i, "window": w} for (n, i), ws in plan.items() for w in range(len(ws))]
    common = {"model_name": model_name, "allow_changed": allow_changed, "warnings": warnings}
    with open_store(model, out_dir, "ppl", params, **common) as store:
        run_grid(model, settings, cells, run_cell, store, progress=progress, desc="ppl")
        names = [s.name for s in settings]
        records = store.records(settings)
        title = f"perplexity ({mode}), {store.model['name']}"
        summary = summary_table(records, names, lengths, metric="ppl", failures=store.failures, title=title)
        summary = store.annotated(summary)
        files = [store.write(settings, summary), store.out_dir / "summary.md"]
    png = line_plot(records, names, lengths, store.out_dir / "ppl.png", metric="ppl", title=title)
    files += [png] if png else []
    return EvalResult("ppl", store.out_dir, list(settings), records, dict(store.failures), summary, files)
