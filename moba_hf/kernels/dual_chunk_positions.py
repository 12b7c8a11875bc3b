"""DCA position remapping: where each query and key sits, and the resulting query-key distances.

c = 8, s = 6, row i = 12 (chunks of keys separated by |)::

    key j      0 1 2 3 4 5 | 6 7 8 9 10 11 | 12
    key pos    0 1 2 3 4 5 | 0 1 2 3  4  5 |  0      j mod s
    query pos  7 7 7 7 7 7 | 6 6 6 6  6  6 |  0      inter: c-1 | successive: min(s + i mod s, c-1) | intra: i mod s
    distance   7 6 5 4 3 2 | 6 5 4 3  2  1 |  0
"""

from __future__ import annotations

import torch

INTRA, SUCCESSIVE, INTER = 0, 1, 2
# relative_positions builds (and format_matrix prints) seq_len**2 entries: 2048 is 32 MiB and 2M printed cells
MAX_MATRIX_LEN = 2048


def _check(seq_len: int, pretraining_length: int, chunk_size: int) -> None:
    for name, value, low in (("seq_len", seq_len, 1), ("pretraining_length", pretraining_length, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 0 < chunk_size < pretraining_length:
        raise ValueError(
            f"chunk_size must be an integer with 0 < chunk_size < pretraining_length (1..{pretraining_length - 1}), "
            f"got {chunk_size!r}"
        )


def query_positions(query_index: torch.Tensor, pretraining_length: int, chunk_size: int) -> torch.Tensor:
    """The three positions of each query: [..., 3] = (intra, successive, inter)."""
    local = query_index % chunk_size
    succ = (local + chunk_size).clamp(max=pretraining_length - 1)
    inter = torch.full_like(local, pretraining_length - 1)
    return torch.stack([local, succ, inter], dim=-1)


def region(query_index: torch.Tensor, key_index: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """INTRA / SUCCESSIVE / INTER for each (query, key) pair (broadcast), from their chunk distance."""
    return (query_index // chunk_size - key_index // chunk_size).clamp(min=0, max=INTER)


def relative_positions(seq_len: int, pretraining_length: int, chunk_size: int) -> torch.Tensor:
    """[seq_len, seq_len] int64 matrix of remapped query-key distances; -1 above the diagonal (never attended)."""
    _check(seq_len, pretraining_length, chunk_size)
    if seq_len > MAX_MATRIX_LEN:
        raise ValueError(
            f"seq_len must be <= {MAX_MATRIX_LEN} for the [seq_len, seq_len] matrix ({seq_len}**2 entries would not "
            f"print sensibly), got {seq_len}"
        )
    idx = torch.arange(seq_len)
    q_pos = query_positions(idx, pretraining_length, chunk_size)  # [N, 3]
    which = region(idx[:, None], idx[None, :], chunk_size)  # [N, N]
    distance = q_pos.gather(1, which) - (idx % chunk_size)[None, :]
    return distance.masked_fill(idx[None, :] > idx[:, None], -1)


def format_matrix(matrix: torch.Tensor, chunk_size: int) -> str:
    """Lower triangle as text, chunks of keys separated by '|'."""
    n = matrix.shape[0]
    width = max(1, len(str(int(matrix.max())))) if n else 1
    lines = []
    for i in range(n):
        cells = []
        for j in range(i + 1):
            if j and j % chunk_size == 0:
                cells.append("|")
            cells.append(f"{int(matrix[i, j]):>{width}}")
        lines.append(f"{i:>{len(str(n - 1))}}: " + " ".join(cells))
    return "\n".join(lines)
