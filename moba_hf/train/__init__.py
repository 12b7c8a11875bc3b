"""Continued training with MoBA: config, packed data, attention schedules, the Trainer and `moba-hf train`."""

# Names are imported on first use, so that `moba-hf train --help` does not load torch, transformers and peft.
from __future__ import annotations

from ..lazy import lazy_names

_WHERE = {
    "AttentionSchedule": "schedule",
    "Document": "data",
    "EXAMPLE_CONFIG": "cli",
    "PackedDataset": "data",
    "RunRefused": "resume",
    "TrainConfig": "config",
    "TrainResult": "trainer",
    "build_dataset": "trainer",
    "build_trainer": "trainer",
    "collate": "data",
    "last_checkpoint": "trainer",
    "pack": "data",
    "prepare_model": "trainer",
    "read_documents": "data",
    "retrieval_document": "synthetic",
    "retrieval_mixture": "synthetic",
    "train": "trainer",
}

__all__ = sorted(_WHERE)
__getattr__ = lazy_names(__name__, _WHERE)
