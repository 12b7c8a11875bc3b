"""Continued training with MoBA: config, packed data, attention schedules, the Trainer and `moba-hf train`."""

from .config import TrainConfig
from .data import Document, PackedDataset, collate, pack, read_documents
from .schedule import AttentionSchedule
from .synthetic import retrieval_document, retrieval_mixture
from .trainer import TrainResult, build_dataset, build_trainer, last_checkpoint, load_model, prepare_model, train

__all__ = [
    "AttentionSchedule",
    "Document",
    "PackedDataset",
    "TrainConfig",
    "TrainResult",
    "build_dataset",
    "build_trainer",
    "collate",
    "last_checkpoint",
    "load_model",
    "pack",
    "prepare_model",
    "read_documents",
    "retrieval_document",
    "retrieval_mixture",
    "train",
]
