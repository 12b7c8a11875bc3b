"""Where each sequence's tokens sit in a batch row: padding (left or right) and packed documents.

MoBA lays out blocks per sequence from its real tokens, so a padded or packed row is split into its
sequences before attention; a row that is one plain sequence goes to the kernel unchanged.
"""

from __future__ import annotations

import torch


def padding_mask_2d(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int = 0) -> torch.Tensor | None:
    """[B, kv_length] bool of real (non-pad) keys, or None when every key is real."""
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.bool)
    missing = kv_length + kv_offset - mask.shape[-1]
    if missing > 0:
        mask = torch.nn.functional.pad(mask, (0, missing), value=True)
    mask = mask[:, kv_offset : kv_offset + kv_length]
    return None if bool(mask.all()) else mask


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Packed rows: a new document starts wherever the position does not advance by exactly one
    (the rule transformers uses for `DataCollatorWithFlattening`). [B, N] -> [B, N] int ids."""
    step = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - 1)
    return (step != 1).cumsum(dim=-1)


def sequence_spans(
    padding_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    batch_size: int,
    q_length: int,
    kv_length: int,
) -> list[tuple[int, torch.Tensor]] | None:
    """Split rows into sequences: a list of (row, key_indices), or None if each row is one whole sequence.

    `key_indices` (ascending) are the keys of one sequence; its queries are those of its keys that fall
    among the last `q_length` positions. Packing is looked for only without a cache (q_length == kv_length).
    """
    check_packing = position_ids is not None and q_length == kv_length and kv_length > 1
    if check_packing:
        position_ids = position_ids.expand(batch_size, -1)
    if padding_mask is None and not (check_packing and bool((document_ids(position_ids) != 0).any())):
        return None

    spans: list[tuple[int, torch.Tensor]] = []
    device = padding_mask.device if padding_mask is not None else position_ids.device
    positions = torch.arange(kv_length, device=device)
    for row in range(batch_size):
        real = positions if padding_mask is None else positions[padding_mask[row]]
        if not check_packing or real.numel() == 0:
            spans.append((row, real))
            continue
        ids = document_ids(position_ids[row, real][None])[0]  # pads are dropped before numbering
        for doc in torch.unique_consecutive(ids):
            spans.append((row, real[ids == doc]))
    return spans
