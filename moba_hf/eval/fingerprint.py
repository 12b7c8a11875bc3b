"""The weights' fingerprint that run.json pins a run's model by, beside its name (`weights_fingerprint`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .run_records import atomic_write_text

logger = logging.getLogger("moba_hf")

# the files from_pretrained reads weights from (Trainer checkpoints also hold optimizer.pt, rng_state.pth ...)
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".index.json")
DIGESTS_FILE = "file_digests.json"  # under rundir.cache_root(): sha256 per (path, size, mtime_ns, ctime_ns, inode)
CACHE_MIN_BYTES = 1 << 26  # smaller files are hashed again (64 MiB: about 50 ms)


def _is_weight_file(path: Path) -> bool:
    name = path.name
    return name.endswith(_WEIGHT_SUFFIXES) or (name.startswith("pytorch_model") and name.endswith(".bin"))


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    # any write changes mtime and ctime, and ctime cannot be set back: an overwrite of the same size is seen
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def file_digests(paths: Sequence[Path]) -> dict[Path, str]:
    """sha256 of each file's content, streamed; files of CACHE_MIN_BYTES or more are cached under
    `rundir.cache_root()` per (path, size, mtime_ns, ctime_ns, inode), so a multi-GB checkpoint is read once
    (sha256 runs at about 1.2 GB/s on one core of this project's 2-core build machine, measured 2026-12-03)
    and a resume costs a stat per file."""
    from ..rundir import cache_root

    cache_path = cache_root() / DIGESTS_FILE
    try:
        cache = json.loads(cache_path.read_text())
        cache = cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        cache = {}  # a missing or damaged cache only costs a re-read
    out, fresh = {}, False
    for path in paths:
        real, key = str(path.resolve()), _stat_key(path)
        entry = cache.get(real)
        if isinstance(entry, dict) and entry.get("stat") == key and isinstance(entry.get("sha256"), str):
            out[path] = entry["sha256"]
            continue
        if key[0] > 1 << 30:
            logger.info("moba_hf eval: hashing %s (%.1f GB) for the weights' fingerprint", path, key[0] / 1e9)
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda fh=fh: fh.read(1 << 23), b""):
                digest.update(chunk)
        out[path] = digest.hexdigest()
        if key[0] >= CACHE_MIN_BYTES:
            cache[real], fresh = {"stat": key, "sha256": out[path]}, True
    if fresh:
        cache = {p: e for p, e in cache.items() if os.path.exists(p)}  # forget deleted files
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cache_path, json.dumps(cache))
        except OSError as error:
            logger.info("moba_hf eval: could not cache file digests in %s: %s", cache_path, error)
    return out


def _normalized_config(path: Path) -> str:
    """config.json without the transformers version that wrote it (a re-save by a newer version is the same model)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return hashlib.sha256(path.read_bytes()).hexdigest()
    if isinstance(data, dict):
        data.pop("transformers_version", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def weights_fingerprint(model: Any) -> str:
    """What run.json pins a run's model by, beside its name:

    files:sha256:...   the checkpoint directory the model was loaded from (config._name_or_path): the content of
                       its weight files (*.safetensors, pytorch_model*.bin, *.gguf, their indexes) and its
                       config.json
    hub:ID@COMMIT      a hub model without a local directory: the commit transformers resolved
    params:sha256:...  a model built in Python: the bytes of every tensor of its state_dict
    """
    config = getattr(model, "config", None)
    source = str(getattr(config, "_name_or_path", "") or "")
    directory = Path(source).expanduser() if source else None
    weights = []
    if directory is not None and directory.is_dir():
        weights = sorted(p for p in directory.iterdir() if p.is_file() and _is_weight_file(p))
    if weights:
        digest = hashlib.sha256()
        for path, content in file_digests(weights).items():
            digest.update(f"{path.name}\0{content}\0".encode())
        if (directory / "config.json").is_file():
            digest.update(f"config.json\0{_normalized_config(directory / 'config.json')}\0".encode())
        return f"files:sha256:{digest.hexdigest()[:32]}"
    commit = getattr(config, "_commit_hash", None)
    if source and commit:
        return f"hub:{source}@{commit}"
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach()
        digest.update(f"{name}\0{str(tensor.dtype)}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).contiguous().cpu().view(torch.uint8).numpy())
    return f"params:sha256:{digest.hexdigest()[:32]}"
