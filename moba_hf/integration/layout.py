"""Where each sequence's tokens sit in a batch row: padding (left or right) and packed documents.

MoBA lays out blocks per sequence from its real tokens, so a padded or packed row is split into its
sequences before attention; a row that is one plain sequence goes to the kernel unchanged.

The split is worked out once per forward, in the "moba" mask function, as the one 2-D *layout* tensor every
layer receives as its `attention_mask`::

    None                      every row is one whole sequence
    bool  [B, kv_length]      padding: False marks a pad key
    int64 [B, kv_length]      packed rows: the document id of each key (no padding)
    int8 [B, 1, 1, kv_length] a pre-allocated cache (StaticCache): each slot unwritten, a pad or real
                              (`static_layout`); the attention reads the written slots and goes on with the above

Packing rule (transformers' own): a row is packed only where transformers' mask says so -- it checks
`position_ids` (a new document wherever the position does not advance by exactly one) only when the forward has
no `attention_mask` and no cache. With an attention mask or a cache (also an empty one: `model(...)` in eval mode
creates a DynamicCache), position ids with gaps or strides are just positions, and attention is causal over the
whole row. The layout reads that decision from the mask function transformers built, so the two never disagree.

Under torch.compile the mask function is traced into the graph: it then skips the data-dependent shortcut (an
all-real mask or a row of one document becomes None) and hands the mask or the ids on as they are; `sequence_spans`,
which runs eagerly in the attention call, treats a layout that splits nothing as None, so every path computes the same.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch


def _traced() -> bool:
    """Whether torch.compile is tracing this call (then no branch may depend on tensor values)."""
    return torch.compiler.is_compiling()


def check_attention_mask(attention_mask: torch.Tensor, batch_size: int, key_length: int) -> None:
    """Refuse a 2-D attention_mask that is not one row per batch row and one column per key (the cached keys
    included): a shorter or longer mask would mark the wrong keys as padding, a single row would hide the others'."""
    if tuple(attention_mask.shape) != (batch_size, key_length):
        raise ValueError(
            f"attention_mask must have shape (batch, keys) = ({batch_size}, {key_length}): one column per key, the "
            f"cached ones included; got shape {tuple(attention_mask.shape)}"
        )


def padding_mask_2d(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int = 0) -> torch.Tensor | None:
    """[B, kv_length] bool of real (non-pad) keys kv_offset .. kv_offset + kv_length - 1 of a [B, kv_offset +
    kv_length] attention mask (see `check_attention_mask`), or None when every key is real."""
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.bool)[:, kv_offset : kv_offset + kv_length]
    if _traced():  # no data-dependent branch (see the module docstring)
        return mask
    return None if bool(mask.all()) else mask


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """transformers' packing rule (`find_packed_sequence_indices`): a new document starts wherever the position
    does not advance by exactly one. [B, N] -> [B, N] int64 ids from 0."""
    step = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - 1)
    return (step != 1).cumsum(dim=-1)


def packed_documents(
    mask_function: Callable | None, batch_size: int, q_length: int, kv_length: int, kv_offset: int = 0, device=None
) -> torch.Tensor | None:
    """Document ids [B, kv_length] where transformers' `mask_function` separates packed documents, else None.

    Query i starts a new document exactly when the mask forbids it its predecessor key i - 1 (a causal mask
    always allows it), so one probe per token reads transformers' decision, whatever rule produced it.
    transformers packs only full forwards (q_length == kv_length, no cache offset).
    """
    if mask_function is None or q_length != kv_length or kv_offset != 0 or kv_length < 2:
        return None
    i = torch.arange(1, kv_length, device=device)[None, :]
    rows = torch.arange(batch_size, device=device)[:, None]
    with torch.no_grad():
        sees_previous = torch.as_tensor(mask_function(rows, torch.zeros_like(rows), i, i - 1), device=device)
    starts = ~sees_previous.to(torch.bool).expand(batch_size, kv_length - 1)
    if not _traced() and not bool(starts.any()):  # traced: the ids, even when all 0
        return None
    return torch.nn.functional.pad(starts.to(torch.long).cumsum(dim=-1), (1, 0))


def forward_layout(
    attention_mask: torch.Tensor | None,
    mask_function: Callable | None,
    batch_size: int,
    q_length: int,
    kv_length: int,
    kv_offset: int = 0,
    device=None,
) -> torch.Tensor | None:
    """The layout tensor (see the module docstring) for one forward, from the arguments transformers hands the
    "moba" mask function. With an attention mask transformers never packs, so only padding can split a row."""
    if attention_mask is not None:
        check_attention_mask(attention_mask, batch_size, kv_offset + kv_length)
        return padding_mask_2d(attention_mask, kv_length, kv_offset)
    return packed_documents(mask_function, batch_size, q_length, kv_length, kv_offset, device)


def _splits(layout: torch.Tensor) -> bool:
    """Whether a layout splits anything: a pad key, or a row of more than one document."""
    if layout.dtype == torch.bool:
        return not bool(layout.all())
    return bool((layout[:, -1] != layout[:, 0]).any())


def sequence_spans(
    layout: torch.Tensor | None,
    batch_size: int,
    q_length: int,
    kv_length: int,
) -> list[tuple[int, torch.Tensor]] | None:
    """Split rows into sequences: a list of (row, key_indices), or None if each row is one whole sequence.

    layout: None, a bool padding mask or int64 document ids [B, kv_length] (see the module docstring).
    `key_indices` (ascending) are the keys of one sequence; its queries are those of its keys that fall among the
    last `q_length` positions. position_ids are not read: whether a row is packed is transformers' decision,
    carried by the layout (a stride or gap in position_ids alone splits nothing).
    """
    if layout is None or not _splits(layout):
        return None
    positions = torch.arange(kv_length, device=layout.device)
    spans: list[tuple[int, torch.Tensor]] = []
    if layout.dtype == torch.bool:
        for row in range(batch_size):
            spans.append((row, positions[layout[row]]))
        return spans
    layout = layout.expand(batch_size, -1)
    for row in range(batch_size):
        ids = layout[row]
        for doc in torch.unique_consecutive(ids):
            spans.append((row, positions[ids == doc]))
    return spans


# --- pre-allocated caches (StaticCache) -----------------------------------------------------------------------------
# A StaticCache hands every layer keys of all its max_cache_len slots, the first `written` of them filled. Its
# layout says which: int8 [B, 1, 1, kv_length], one value per slot. Four dimensions, so that transformers passes
# the layout `generate` prepares before a step to the forward as it is (it takes a 4-D mask as prepared), and the
# values are computed from tensors only (the slots written follow the cache's length tensor): no host sync, one
# shape for every step, so a compiled step traces it once.
UNWRITTEN, PAD, REAL = 0, 1, 2


def static_layout(
    attention_mask: torch.Tensor | None,
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: torch.Tensor | int,
    kv_offset: int = 0,
    device=None,
) -> torch.Tensor:
    """The layout of a forward into a pre-allocated cache: int8 [B, 1, 1, kv_length], UNWRITTEN for the slots past
    the q_offset + q_length written ones, PAD / REAL for the written ones (attention_mask [B, <= kv_offset +
    kv_length], 0 marks a pad; None: every written key real). q_offset: the tokens the cache held before (a 0-d
    tensor for a StaticCache, which keeps its length as one)."""
    total = kv_offset + kv_length
    if not isinstance(q_offset, torch.Tensor) and q_offset + q_length > total:
        raise ValueError(
            f"the cache holds {total} tokens (max_cache_len), the forward needs {q_offset + q_length} "
            f"({q_offset} cached + {q_length} new): allocate a larger cache"
        )
    if device is None:
        device = next((t.device for t in (attention_mask, q_offset) if isinstance(t, torch.Tensor)), None)
    slots = torch.arange(kv_offset, total, device=device)
    written = (slots < q_offset + q_length).to(torch.int8)  # [kv_length]
    if attention_mask is None:
        return (written * REAL).expand(batch_size, kv_length).reshape(batch_size, 1, 1, kv_length)
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size or attention_mask.shape[1] > total:
        raise ValueError(
            f"attention_mask must have shape (batch, keys) = ({batch_size}, at most {total}) with a pre-allocated "
            f"cache of {total} slots: one column per key, the cached ones included; got shape "
            f"{tuple(attention_mask.shape)}"
        )
    real = torch.nn.functional.pad(attention_mask.to(torch.bool), (0, total - attention_mask.shape[1]))
    real = real[:, kv_offset:total].to(device=device, dtype=torch.int8)
    return (written * (PAD + real)).reshape(batch_size, 1, 1, kv_length)


def is_static_layout(layout: torch.Tensor | None) -> bool:
    """Whether an attention function's mask is `static_layout`'s (no user mask is int8 and [B, 1, 1, N])."""
    return layout is not None and layout.dim() == 4 and layout.dtype == torch.int8 and layout.shape[1:3] == (1, 1)


# the last layout read and its answer: every layer of a forward gets the same layout tensor
_last_static = threading.local()


def static_keys(layout: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """(written, padding): the slots a `static_layout` marks written (every row has as many), and the bool
    padding mask [B, written] of the real ones, None when all are real. Reads the layout on the host (one sync:
    the attention call runs eagerly), once per forward: the next layers get the answer kept for the same tensor."""
    last = getattr(_last_static, "value", None)
    if last is not None and last[0]() is layout and last[1] == layout._version:
        return last[2]
    rows = layout[:, 0, 0]
    written = int((rows[0] != UNWRITTEN).sum())
    real = rows[:, :written] == REAL
    answer = (written, None if bool(real.all()) else real)
    _last_static.value = (weakref.ref(layout), layout._version, answer)
    return answer


def static_slots(layout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(real, last) of a one-token step's `static_layout`, as tensors only (nothing read on the host, so a captured
    graph replays it): real, bool [B, slots], the written slots holding real tokens; last, the new token's slot
    (0-d: every row writes the same one)."""
    rows = layout[:, 0, 0]
    return rows == REAL, (rows[0] != UNWRITTEN).sum() - 1
