"""Training data: documents from text / JSONL / a `datasets` name / the synthetic generator, tokenized and
packed into fixed-length rows.

A packed row holds several documents; `position_ids` restart at 0 at each document start, which is how
both the "moba" attention (`integration.layout.sequence_spans`) and transformers' own masks (sdpa) tell
documents apart, so no token attends across a document boundary:

    input_ids     | a0 a1 a2 a3 | b0 b1 b2 | c0 c1 | pad pad |
    position_ids  |  0  1  2  3 |  0  1  2 |  0  1 |  0   1  |
    labels        |  -  a1 a2 a3|  -  b1 b2|  -  c1|  -   -  |   (- = -100: no loss)

The first token of each document gets no label, since it would be predicted from the previous document.
The loss shifts labels by one (logits at t predict labels at t + 1), so a label at a row's position 0 is
never trained on either: a row trains only if one of labels[1:] is set (`has_target`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("moba_hf")

IGNORE = -100


@dataclasses.dataclass
class Document:
    """Token ids of one document and the ids it is trained on (`labels`, IGNORE = no loss)."""

    input_ids: list[int]
    labels: list[int]


def read_texts(source: str, *, text_field: str = "text", split: str = "train", limit: int | None = None) -> list[str]:
    """Documents from a .txt file (blank-line separated), a .jsonl file (`text_field`), or a `datasets` name."""
    path = Path(source)
    if path.suffix == ".txt" and path.is_file():
        texts = [t.strip() for t in _read_text(path).split("\n\n") if t.strip()]
    elif path.suffix == ".jsonl" and path.is_file():
        texts = []
        for n, record in read_jsonl(path):
            if text_field not in record:
                raise ValueError(f"{path}:{n}: record has no text_field={text_field!r}; keys: {sorted(record)}")
            texts.append(str(record[text_field]))
    elif path.exists():
        raise ValueError(f"data source {source} must be a .txt or .jsonl file (or a `datasets` name)")
    else:
        import datasets

        dataset = datasets.load_dataset(source, split=split)
        if text_field not in dataset.column_names:
            raise ValueError(
                f"dataset {source!r} has no column text_field={text_field!r}; columns: {dataset.column_names}"
            )
        texts = [str(t) for t in dataset[text_field]]
    return texts[:limit] if limit is not None else texts


def read_documents(
    source: str,
    tokenizer: Any,
    *,
    text_field: str = "text",
    split: str = "train",
    limit: int | None = None,
    vocab_size: int | None = None,
) -> list[Document]:
    """Documents from `source` (see `read_texts`); JSONL records may instead carry ready `input_ids`
    (lists of token ids, e.g. for a model without a tokenizer), checked here: integers in [0, vocab_size)
    (`labels` may also hold IGNORE); an error names the file, the line, the value and that range."""
    path = Path(source)
    if path.suffix == ".jsonl" and path.is_file():
        records = read_jsonl(path)
        with_ids = [n for n, r in records if "input_ids" in r]
        if with_ids and len(with_ids) < len(records):
            n = next(n for n, r in records if "input_ids" not in r)
            raise ValueError(
                f"{path}:{n}: record has no input_ids, while line {with_ids[0]} has: give every record "
                f"input_ids (token ids) or every record {text_field!r} (text)"
            )
        if with_ids:
            docs = [_token_document(path, n, r, vocab_size) for n, r in records]
            return docs[:limit] if limit is not None else docs
    if tokenizer is None:
        raise ValueError(f"data source {source!r} holds text, so the model needs a tokenizer")
    return tokenize_texts(tokenizer, read_texts(source, text_field=text_field, split=split, limit=limit))


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) for each non-blank line; a line that is no JSON object is refused by its number."""
    records = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: not valid JSON ({err.msg} at column {err.colno}): {line[:80]!r}") from None
        except RecursionError:
            raise ValueError(f"{path}:{n}: JSON nested too deeply to read") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{n}: a record must be a JSON object, got {type(record).__name__}")
        records.append((n, record))
    return records


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None


def _token_document(path: Path, line: int, record: dict, vocab_size: int | None) -> Document:
    ids = _token_ids(path, line, record, "input_ids", vocab_size)
    labels = _token_ids(path, line, record, "labels", vocab_size, ignore=True) if "labels" in record else ids
    if len(labels) != len(ids):
        raise ValueError(f"{path}:{line}: {len(ids)} input_ids but {len(labels)} labels; give one label per token")
    return Document(ids, list(labels))


def _token_ids(
    path: Path, line: int, record: dict, key: str, vocab_size: int | None, *, ignore: bool = False
) -> list[int]:
    ids = record[key]
    valid = f"integers in [0, {vocab_size})" if vocab_size is not None else "integers >= 0"
    valid += f" or {IGNORE} (no loss)" if ignore else ""
    if not isinstance(ids, list):
        raise ValueError(f"{path}:{line}: {key} must be a list of token ids ({valid}), got {ids!r:.80}")
    for i, t in enumerate(ids):
        in_range = not isinstance(t, bool) and isinstance(t, int) and (0 <= t or (ignore and t == IGNORE))
        if not in_range or (vocab_size is not None and t >= vocab_size):
            raise ValueError(f"{path}:{line}: {key}[{i}] = {t!r} is no token id of this model; valid: {valid}")
    return ids


def tokenize_texts(tokenizer: Any, texts: Iterable[str]) -> list[Document]:
    """Plain language-model documents: every token (but the first) is a target; EOS closes each document."""
    eos = tokenizer.eos_token_id
    docs = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if eos is not None:
            ids = ids + [eos]
        docs.append(Document(ids, list(ids)))
    return docs


def pack(documents: Sequence[Document], seq_len: int, *, split_documents: bool = True, pad_id: int = 0) -> list[dict]:
    """Pack documents into rows of `seq_len` tokens: dicts of input_ids / labels / position_ids (1-D tensors).

    split_documents=True: documents are concatenated and the stream is cut every `seq_len` tokens (a document
    cut at a row end continues, positions continuing, in the next row; no token is dropped).
    split_documents=False: a document never straddles rows (longer ones are truncated to `seq_len`); a row is
    closed when the next document does not fit, and its tail is padded.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    rows: list[dict] = []
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []

    def close_row() -> None:
        if not ids:
            return
        fill = seq_len - len(ids)
        # padding is its own "document" (positions from 0) with no labels; being last, no real token sees it
        rows.append(
            {
                "input_ids": torch.tensor(ids + [pad_id] * fill),
                "labels": torch.tensor(labels + [IGNORE] * fill),
                "position_ids": torch.tensor(positions + list(range(fill))),
            }
        )
        ids.clear()
        labels.clear()
        positions.clear()

    truncated = 0
    for doc in documents:
        doc_ids, doc_labels = list(doc.input_ids), list(doc.labels)
        if len(doc_ids) != len(doc_labels):
            raise ValueError(f"a document has {len(doc_ids)} input_ids but {len(doc_labels)} labels")
        if not doc_ids:
            continue
        doc_labels[0] = IGNORE
        if not split_documents:
            if len(doc_ids) > seq_len:
                truncated += 1
                doc_ids, doc_labels = doc_ids[:seq_len], doc_labels[:seq_len]
            if len(ids) + len(doc_ids) > seq_len:
                close_row()
            ids.extend(doc_ids)
            labels.extend(doc_labels)
            positions.extend(range(len(doc_ids)))
            continue
        start = 0
        while start < len(doc_ids):
            take = min(seq_len - len(ids), len(doc_ids) - start)
            ids.extend(doc_ids[start : start + take])
            labels.extend(doc_labels[start : start + take])
            positions.extend(range(start, start + take))
            start += take
            if len(ids) == seq_len:
                close_row()
    close_row()
    if truncated:
        logger.warning("moba_hf: truncated %d documents longer than seq_len=%d", truncated, seq_len)
    return rows


def has_target(row: dict) -> bool:
    """Does the row train anything? Position 0's label is never predicted (see the module docstring)."""
    return bool((row["labels"][1:] != IGNORE).any())


def first_target(document: Document) -> int | None:
    """Index of the first label the loss can see (>= 1: the first token of a document gets none), or None."""
    return next((i for i, t in enumerate(document.labels[1:], 1) if t != IGNORE), None)


def drop_untrained_rows(
    rows: list[dict], documents: Sequence[Document], *, seq_len: int, split_documents: bool
) -> list[dict]:
    """The rows with a target; ValueError when none has one, one warning with the count when some have none.

    A row without a target costs a step that logs loss 0 and grad_norm 0, and Adam still moves the weights
    on its momentum, so such rows are dropped rather than trained on.
    """
    kept = [row for row in rows if has_target(row)]
    if not kept:
        firsts = [i for i in (first_target(d) for d in documents) if i is not None]
        if not firsts:
            raise ValueError(
                f"no document has a trainable target (every label is {IGNORE}); "
                "check data.loss_on (e.g. 'all') or the labels of the data source"
            )
        if split_documents:
            hint = (
                f"a larger data.seq_len (the shortest document has {min(len(d.input_ids) for d in documents)} tokens)"
            )
        else:
            hint = (
                f"data.seq_len >= {min(firsts) + 1} (documents are cut to seq_len and their first target sits at "
                f"token {min(firsts)} at the earliest) or data.split_documents = true"
            )
        raise ValueError(
            f"data.seq_len={seq_len} leaves no trainable target in any of the {len(rows)} packed rows "
            f"(all their labels are {IGNORE}, so every step would log loss 0); use {hint}"
        )
    if len(kept) < len(rows):
        logger.warning(
            "moba_hf: dropped %d of %d packed rows that hold no trainable target at data.seq_len=%d",
            len(rows) - len(kept),
            len(rows),
            seq_len,
        )
    return kept


class PackedDataset(torch.utils.data.Dataset):
    """The packed rows, as the HF Trainer reads them."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Stack rows; no attention_mask: documents are separated by `position_ids` (see the module docstring)."""
    return {key: torch.stack([row[key] for row in rows]) for key in ("input_ids", "labels", "position_ids")}
