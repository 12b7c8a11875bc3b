"""Continued training with MoBA on the HF `Trainer` (accelerate underneath: DDP / FSDP via `accelerate launch`).

    from moba_hf.train import TrainConfig, train
    result = train(TrainConfig.from_file("configs/train_cpu_demo.toml"))

No communication code lives here: the Trainer / accelerate handle devices, processes and sharding.
"""

from __future__ import annotations

import contextlib
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

from .. import models
from ..integration import apply
from ..rundir import DirLock, lock_dir
from ..window import check_positions
from .config import TrainConfig
from .data import PackedDataset, collate, drop_untrained_rows, pack, read_documents
from .resume import (
    RESTORED_FROM_OPTIMIZER,
    RUN_FILE,
    RunRefused,
    check_resume,
    checkpoint_step,
    is_main_process,
    resume_checkpoint,
    run_files,
    run_record,
    write_record,
)
from .schedule import AttentionSchedule, base_model
from .synthetic import retrieval_mixture

logger = logging.getLogger("moba_hf")
IN_USE = (
    "two trainings into one directory would mix their checkpoints and records; wait for it to finish, or give "
    "another output directory (--out, train.output_dir)"
)


@dataclasses.dataclass
class TrainResult:
    output_dir: Path | None
    losses: list[float]  # the training loss logged at each logging step
    modes: dict[int, str]  # optimizer step -> "moba" / "full"
    sparsity: list[dict]  # measured sparsity records (see AttentionSchedule)
    is_main_process: bool = True
    resumed_from: Path | None = None  # the checkpoint a `resume=True` run continued from
    finished_at: int | None = None  # a resume of a run already at train.max_steps: its step (nothing was trained)


class MobaTrainer(Trainer):
    """The HF Trainer with three changes: FSDP also on CPU processes, checkpoints that Ctrl-C cannot cut and
    that carry the run record (`run_config.json`), and a resume that applies a changed learning rate or weight
    decay (the Trainer would restore the checkpoint's values from optimizer.pt and scheduler.pt)."""

    run_record: dict | None = None  # written into each checkpoint
    changed_on_resume: tuple[str, ...] = ()  # keys of RESTORED_FROM_OPTIMIZER whose new value must be put back

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
        # signal handlers live in the main thread; a process started with SIGINT ignored (nohup, `cmd &` in a
        # script) keeps ignoring it, and a handler set outside Python could not be put back
        in_main_thread = threading.current_thread() is threading.main_thread()
        if not in_main_thread or signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None):
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
            if self.run_record is not None:
                write_record(checkpoint / RUN_FILE, self.run_record)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        fresh = [dict(group) for group in self.optimizer.param_groups]  # built from this run's arguments
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        groups = self.optimizer.param_groups
        if "train.weight_decay" in self.changed_on_resume:
            for group, new in zip(groups, fresh, strict=True):
                group["weight_decay"] = new["weight_decay"]
        if "train.learning_rate" in self.changed_on_resume:
            scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
            for group, new in zip(groups, fresh, strict=True):
                base = new.get("initial_lr", new["lr"])
                group["lr"] *= base / group.get("initial_lr", group["lr"])  # the schedule's factor carries over
                group["initial_lr"] = base
            scheduler.base_lrs = [group["initial_lr"] for group in groups]
            scheduler._last_lr = [group["lr"] for group in groups]


def last_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest checkpoint-N in output_dir holding trainer_state.json (written last); `resume.resume_checkpoint`
    also reads its files back and skips a corrupt one."""
    steps = []
    for path in Path(output_dir).glob("checkpoint-*"):
        match = re.fullmatch(r"checkpoint-(\d+)", path.name)
        if match and (path / "trainer_state.json").is_file():
            steps.append((int(match.group(1)), path))
    return max(steps)[1] if steps else None


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


def build_dataset(config: TrainConfig, tokenizer: Any, *, vocab_size: int | None = None) -> PackedDataset:
    """The packed rows of `config.data`; token ids read from JSONL are checked against [0, vocab_size)."""
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
            data.source,
            tokenizer,
            text_field=data.text_field,
            split=data.split,
            limit=data.max_documents,
            vocab_size=vocab_size,
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
        # a bare checkpoint gives tokenizer None: its data must then come as token ids
        model, tokenizer = models.load_model(config.model.name, dtype=config.model.dtype, tokenizer="optional")
    model = prepare_model(model, config)
    if dataset is None:
        dataset = build_dataset(config, tokenizer, vocab_size=vocab_size(model))
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
    allow_config_change: bool = False,
) -> TrainResult:
    """Train and (if `train.save`) save a checkpoint whose config.json carries `moba_config`.

    resume=True continues from the newest whole checkpoint in the output directory (`train.save_steps` makes
    them; a newer corrupt one is skipped with a log line): weights, optimizer, scheduler, RNG, data position and
    the MoBA / full phase, as the HF Trainer's resume_from_checkpoint does. A config, data or model that differs
    from the checkpoint's run, or a checkpoint without optimizer state, is refused (RunRefused, naming each
    key with both values); allow_config_change=True continues with the new values, logs them and appends them to
    `config_changes` in run_config.json (`resume.FIXED` lists what no resume can change). A resume of a run
    whose checkpoint is at `train.max_steps` (finished) trains and writes nothing: one log line, and
    `finished_at` in the result; a raised `train.max_steps` continues it (recorded in `config_changes`).

    The output directory is locked while the run lives (`run.lock`, as eval's): a second run into it is
    refused, naming the directory and the pid of the first. A new run (resume=False) into a directory that holds
    another run's files (run_config.json, checkpoint-N, ...) is refused, naming them.
    """
    if allow_config_change and not resume:
        raise RunRefused("allow_config_change applies to a resume (resume=True, --resume) only")
    out = Path(output_dir or config.train.output_dir)
    created = [p for p in (out.absolute(), *out.absolute().parents) if not p.exists()]  # the leaf first
    held = claim_output_dir(out, resume=resume) if is_main_process() else DirLock(None)
    try:
        return _train(config, model, tokenizer, dataset, output_dir, callbacks, resume, allow_config_change)
    except RunRefused:
        held.release()
        with contextlib.suppress(OSError):  # refused before anything was written: leave no directory behind
            for path in created:
                path.rmdir()
        raise
    finally:
        held.release()


def claim_output_dir(out: Path, *, resume: bool) -> DirLock:
    """The lock of this run on `out` (created if missing); RunRefused when another process holds it, or when a
    new run (no resume) would write into a directory that holds another run's files."""
    if out.exists() and not out.is_dir():
        raise RunRefused(f"train.output_dir {out} is a file; give a directory")
    out.mkdir(parents=True, exist_ok=True)
    held = lock_dir(out, why=IN_USE, error=RunRefused)
    found = [] if resume else run_files(out)
    if found:
        held.release()
        listed = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
        resumable = any(name.startswith("checkpoint-") for name in found)
        go_on = "continue it with --resume (train(..., resume=True)), " if resumable else ""
        raise RunRefused(
            f"{out} holds another training run ({listed}): a new run into it would replace its checkpoints and "
            f"append to its records; {go_on}give another output directory (--out, train.output_dir), or remove "
            "these files first"
        )
    return held


def _train(
    config: TrainConfig,
    model: Any,
    tokenizer: Any,
    dataset: PackedDataset | None,
    output_dir: str | Path | None,
    callbacks: list | None,
    resume: bool,
    allow_config_change: bool,
) -> TrainResult:
    try:  # every refusal comes before the first step, as one RunRefused naming the key, file or line
        checkpoint = resume_checkpoint(Path(output_dir or config.train.output_dir)) if resume else None
        step = checkpoint_step(checkpoint) if checkpoint is not None else None
        if step is not None and step >= config.train.max_steps:  # the Trainer would run one more step, and save
            if is_main_process():
                logger.warning(
                    "moba_hf: %s holds a finished run: %s is at step %d and train.max_steps is %d; nothing to "
                    "train (raise train.max_steps, --max-steps, to continue it)",
                    checkpoint.parent,
                    checkpoint.name,
                    step,
                    config.train.max_steps,
                )
            return TrainResult(None, [], {}, [], is_main_process(), checkpoint, finished_at=step)
        if model is None:
            model, tokenizer = models.load_model(config.model.name, dtype=config.model.dtype, tokenizer="optional")
        if dataset is None:
            dataset = build_dataset(config, tokenizer, vocab_size=vocab_size(model))
        warn_past_window(config, model, dataset)
        record = run_record(config, model, dataset)
        trainer, schedule = build_trainer(
            config, model=model, tokenizer=tokenizer, dataset=dataset, output_dir=output_dir, callbacks=callbacks
        )
        if checkpoint is not None:
            record, changes = check_resume(checkpoint, record, allow_config_change=allow_config_change)
            trainer.changed_on_resume = tuple(k for k in RESTORED_FROM_OPTIMIZER if k in changes)
            schedule.load(checkpoint, trainer.is_world_process_zero())
    except RunRefused:
        raise
    except ValueError as err:
        raise RunRefused(str(err)) from err
    trainer.run_record = record
    if trainer.is_world_process_zero():
        write_record(Path(trainer.args.output_dir) / RUN_FILE, record)
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
            "config_changes": record["config_changes"],
        }
        (out / "train_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return TrainResult(
        saved, losses, dict(schedule.modes), list(schedule.history), trainer.is_world_process_zero(), checkpoint
    )


def vocab_size(model: Any) -> int | None:
    """Rows of the model's input embedding: the token ids it can read."""
    core = base_model(model)
    embeddings = core.get_input_embeddings() if hasattr(core, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None) or getattr(getattr(core, "config", None), "vocab_size", None)


def warn_past_window(config: TrainConfig, model: Any, dataset: Any) -> None:
    """A warning when the rows use positions past the model's trained window (PastWindow, a refusal, where the
    model has a learned position table), unless DCA keeps the distances inside it."""
    model_config = base_model(model).config
    if config.moba.dca not in (None, False) or getattr(model_config, "dual_chunk_attention_config", None):
        return
    rows = getattr(dataset, "rows", None)
    if not rows:
        return
    positions = max(int(row["position_ids"].max()) for row in rows) + 1
    what = f"data.seq_len={config.data.seq_len}"
    if positions > config.data.seq_len:  # a document cut at a row end continues its positions in the next row
        what += " with data.split_documents = true (documents continue their positions across rows)"
    note = check_positions(model_config, positions, what)
    if note and int(os.environ.get("RANK", "0")) == 0:
        logger.warning("moba_hf: %s", note)


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
