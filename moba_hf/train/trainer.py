"""Continued training with MoBA on the HF `Trainer` (accelerate underneath: DDP / FSDP via `accelerate launch`).

    from moba_hf.train import TrainConfig, train
    result = train(TrainConfig.from_file("configs/train_cpu_demo.toml"))

No communication code lives here: the Trainer / accelerate handle devices, processes and sharding.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import threading
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer

from ..integration import apply
from ..models import EMBEDDED
from .config import TrainConfig
from .data import PackedDataset, collate, drop_untrained_rows, pack, read_documents
from .schedule import AttentionSchedule, base_model
from .synthetic import retrieval_mixture

logger = logging.getLogger("moba_hf")


@dataclasses.dataclass
class TrainResult:
    output_dir: Path | None
    losses: list[float]  # the training loss logged at each logging step
    modes: dict[int, str]  # optimizer step -> "moba" / "full"
    sparsity: list[dict]  # measured sparsity records (see AttentionSchedule)
    is_main_process: bool = True
    resumed_from: Path | None = None  # the checkpoint a `resume=True` run continued from


class MobaTrainer(Trainer):
    """The HF Trainer with two changes: FSDP also on CPU processes, and checkpoints that Ctrl-C cannot cut."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        wanted = self.args.fsdp_plugin_args is not None or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
        if wanted and state.distributed_type == DistributedType.MULTI_CPU:
            # accelerate shards only on accelerators and silently runs DDP on CPU processes; FSDP2 (fully_shard)
            # runs over gloo as well, so a CPU run shards exactly as a GPU run does
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**(self.args.fsdp_plugin_args or {}))
            state.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState does
            self.is_fsdp_enabled = True

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
            return self._write_checkpoint(model, trial)
        interrupted = []
        previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
        try:  # Ctrl-C waits for the checkpoint to be whole, then stops the run
            self._write_checkpoint(model, trial)
        finally:
            signal.signal(signal.SIGINT, previous)
        if interrupted:
            raise KeyboardInterrupt

    def _write_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            checkpoint = Path(self._get_output_dir(trial)) / f"checkpoint-{self.state.global_step}"
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, AttentionSchedule):
                    callback.save(checkpoint)


def last_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest whole checkpoint in output_dir: checkpoint-N holding trainer_state.json (written last)."""
    steps = []
    for path in Path(output_dir).glob("checkpoint-*"):
        match = re.fullmatch(r"checkpoint-(\d+)", path.name)
        if match and (path / "trainer_state.json").is_file():
            steps.append((int(match.group(1)), path))
    return max(steps)[1] if steps else None


def load_model(config: TrainConfig) -> tuple[Any, Any]:
    """(model, tokenizer or None) for `config.model.name`: an embedded name, a local path or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = config.model.name
    if name in EMBEDDED:
        from ..models import local_path

        name = str(local_path(name))
    model = AutoModelForCausalLM.from_pretrained(name, dtype=config.model.dtype, attn_implementation="sdpa")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, TypeError):  # a bare checkpoint: data must then come as token ids
        tokenizer = None
    return model, tokenizer


def prepare_model(model: Any, config: TrainConfig) -> Any:
    """MoBA on, cache off (a cache would hide packed documents from the sdpa mask), freezing or LoRA."""
    apply(model, config.moba)
    model.config.use_cache = False
    if config.model.trainable is not None:
        names = config.model.trainable
        for name, param in model.named_parameters():
            param.requires_grad_(any(part in name for part in names))
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(f"model.trainable={list(names)} matches no parameter name")
    if config.lora.enabled:
        from peft import LoraConfig, get_peft_model

        lora = config.lora
        peft_config = LoraConfig(
            task_type="CAUSAL_LM",
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
        )
        if config.model.gradient_checkpointing:
            model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
        model = get_peft_model(model, peft_config)
    return model


def build_dataset(config: TrainConfig, tokenizer: Any) -> PackedDataset:
    data = config.data
    if data.source == "synthetic":
        if tokenizer is None:
            raise ValueError("data.source='synthetic' needs a model with a tokenizer")
        docs = retrieval_mixture(
            tokenizer,
            data.num_documents,
            min_length=data.min_length,
            max_length=data.max_length,
            seed=data.seed,
            loss_on=data.loss_on,
            eval_format_only=data.eval_format_only,
        )
    else:
        docs = read_documents(
            data.source, tokenizer, text_field=data.text_field, split=data.split, limit=data.max_documents
        )
    pad = 0 if tokenizer is None or tokenizer.pad_token_id is None else tokenizer.pad_token_id
    rows = pack(docs, data.seq_len, split_documents=data.split_documents, pad_id=pad)
    if not rows:
        raise ValueError(f"data source {data.source!r} gave no tokens to train on")
    return PackedDataset(drop_untrained_rows(rows, docs, seq_len=data.seq_len, split_documents=data.split_documents))


def training_arguments(config: TrainConfig, output_dir: str | Path) -> Any:
    from transformers import TrainingArguments

    t = config.train
    extra = {} if t.shuffle else {"train_sampling_strategy": "sequential"}
    if t.save_steps:
        extra.update(save_steps=t.save_steps, save_total_limit=t.save_total_limit or None)
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=t.max_steps,
        per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        learning_rate=t.learning_rate,
        optim=t.optim,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_steps,
        lr_scheduler_type=t.lr_scheduler,
        max_grad_norm=t.max_grad_norm,
        bf16=t.precision == "bf16",
        seed=t.seed,
        data_seed=t.seed,
        logging_steps=t.logging_steps,
        save_strategy="steps" if t.save_steps else "no",
        report_to=[],
        remove_unused_columns=False,
        dataloader_num_workers=t.dataloader_num_workers,
        gradient_checkpointing=config.model.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if config.model.gradient_checkpointing else None,
        fsdp=t.fsdp,
        disable_tqdm=True,
        dataloader_pin_memory=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available() if t.use_cpu is None else t.use_cpu,
        **extra,
    )


def build_trainer(
    config: TrainConfig,
    *,
    model: Any = None,
    tokenizer: Any = None,
    dataset: PackedDataset | None = None,
    output_dir: str | Path | None = None,
    callbacks: list | None = None,
) -> tuple[Any, AttentionSchedule]:
    """(Trainer, schedule callback) ready for `.train()`; pass `model` / `dataset` to skip loading them."""
    if model is None:
        model, tokenizer = load_model(config)
    model = prepare_model(model, config)
    if dataset is None:
        dataset = build_dataset(config, tokenizer)
    schedule = AttentionSchedule(model, config.moba, config.switch_step, sparsity_every=config.train.sparsity_every)
    trainer = MobaTrainer(
        model=model,
        args=training_arguments(config, output_dir or config.train.output_dir),
        train_dataset=dataset,
        data_collator=collate,
        callbacks=[schedule, *(callbacks or [])],
    )
    return trainer, schedule


def train(
    config: TrainConfig,
    *,
    model: Any = None,
    tokenizer: Any = None,
    dataset: PackedDataset | None = None,
    output_dir: str | Path | None = None,
    callbacks: list | None = None,
    resume: bool = False,
) -> TrainResult:
    """Train and (if `train.save`) save a checkpoint whose config.json carries `moba_config`.

    resume=True continues from the newest whole checkpoint in the output directory (`train.save_steps` makes
    them): weights, optimizer, scheduler, RNG, data position and the MoBA / full phase, as the HF Trainer's
    resume_from_checkpoint does.
    """
    checkpoint = None
    if resume:
        checkpoint = last_checkpoint(output_dir or config.train.output_dir)
        if checkpoint is None:
            raise ValueError(
                f"resume: no whole checkpoint (checkpoint-N with trainer_state.json) in "
                f"{output_dir or config.train.output_dir}; runs leave them when train.save_steps > 0"
            )
    if model is None:
        model, tokenizer = load_model(config)
    trainer, schedule = build_trainer(
        config, model=model, tokenizer=tokenizer, dataset=dataset, output_dir=output_dir, callbacks=callbacks
    )
    if checkpoint is not None:
        schedule.load(checkpoint, trainer.is_world_process_zero())
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint is not None else None)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    out = Path(trainer.args.output_dir)
    saved = None
    if config.train.save:
        save(trainer, config, tokenizer, out)
        saved = out
    if trainer.is_world_process_zero():
        out.mkdir(parents=True, exist_ok=True)
        summary = {
            "losses": losses,
            "grad_norms": [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry],
            "modes": schedule.modes,
            "distributed": str(trainer.accelerator.distributed_type.value),  # what really ran: FSDP, MULTI_CPU, ...
            "num_processes": trainer.accelerator.num_processes,
            "config": config.to_dict(),
        }
        (out / "train_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return TrainResult(
        saved, losses, dict(schedule.modes), list(schedule.history), trainer.is_world_process_zero(), checkpoint
    )


def save(trainer: Any, config: TrainConfig, tokenizer: Any, output_dir: Path) -> None:
    """Save a plain transformers checkpoint (LoRA merged) with `moba_config` and attn_implementation "moba"."""
    model = trainer.model
    core = base_model(model)
    core.config.use_cache = True
    core.config.moba_config = config.moba.to_dict()
    if config.lora.enabled:
        if not trainer.is_world_process_zero():
            return
        merged = model.merge_and_unload()
        merged.save_pretrained(output_dir)
    else:
        trainer.save_model(str(output_dir))
    if tokenizer is not None and trainer.is_world_process_zero():
        tokenizer.save_pretrained(output_dir)
