"""`AttentionSchedule`: the `TrainerCallback` that switches attention during training and logs sparsity.

    steps   0 ......................... switch_step ........ max_steps
    attn    MoBA (config.moba)          | full attention (sdpa)        <- moba_fraction = switch_step / max_steps

The switch is a change of `model.config._attn_implementation` ("moba" <-> "sdpa"), which every attention
layer reads at each forward, so it works the same under DDP / FSDP wrappers and peft. `moba_config` stays in
the model config through the full-attention phase, so the saved checkpoint reloads with the trained setting.
The phase follows `state.global_step`, so a resumed run picks it up; each checkpoint also carries the modes
and sparsity so far (attention_schedule.json) for the resumed run's record.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..config import MobaConfig
from ..integration import apply, track_sparsity
from ..rundir import field_problem

logger = logging.getLogger("moba_hf")
SCHEDULE_FILE = "attention_schedule.json"
# attention_schedule.json's fields with their JSON types (read back on resume, refused when one differs)
SCHEDULE_FIELDS = {"modes": dict[str, str], "history": list[dict]}
HISTORY_FIELDS = {"step": int, "overall": float, "per_layer": dict[str, float], "backends": list[str]}


def base_model(model: Any) -> Any:
    """The transformers model under peft / DDP / FSDP wrappers."""
    while True:
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif hasattr(model, "module") and not hasattr(model, "config"):
            model = model.module
        else:
            return model


def schedule_problem(record: Any) -> str | None:
    """What makes a parsed attention_schedule.json other than what `AttentionSchedule.save` writes, or None."""
    if not isinstance(record, dict):
        return "not an object"
    problem = field_problem(record, SCHEDULE_FIELDS, required=tuple(SCHEDULE_FIELDS))
    if problem:
        return problem
    for step, mode in record["modes"].items():
        if not step.isdigit() or mode not in ("moba", "full"):
            return f'modes has {json.dumps(step)}: {json.dumps(mode)}, expected a step number: "moba" or "full"'
    for i, entry in enumerate(record["history"]):
        problem = field_problem(entry, HISTORY_FIELDS, required=tuple(HISTORY_FIELDS))
        if problem is None and not all(k.isdigit() for k in entry["per_layer"]):
            problem = f"field 'per_layer' is {json.dumps(entry['per_layer'])[:60]}, expected layer numbers as keys"
        if problem:
            return f"history[{i}]: {problem}"
    return None


class AttentionSchedule(TrainerCallback):
    """MoBA for optimizer steps [0, switch_step), full attention from `switch_step` on (None: never).

    Every `sparsity_every` steps (0 = never) the MoBA step runs under `track_sparsity()` and the measured
    per-layer sparsity is logged and kept in `history` (written to `<output_dir>/sparsity.jsonl`).
    """

    def __init__(self, model: Any, moba: MobaConfig, switch_step: int | None, *, sparsity_every: int = 0) -> None:
        self.model = base_model(model)
        self.moba = moba
        self.switch_step = switch_step
        self.sparsity_every = sparsity_every
        self.modes: dict[int, str] = {}  # optimizer step -> "moba" / "full"
        self.history: list[dict] = []
        self._tracking: contextlib.ExitStack | None = None
        self._stats = None

    def load(self, checkpoint: Path, is_world_process_zero: bool = True) -> None:
        """Take the record of a checkpoint's steps; sparsity.jsonl is cut back to them (later steps rerun)."""
        path = Path(checkpoint) / SCHEDULE_FILE
        record = json.loads(path.read_text()) if path.is_file() else {"modes": {}, "history": []}
        problem = schedule_problem(record)
        if problem:
            raise ValueError(f"{path}: {problem} (this package writes the file whole: it was edited since)")
        self.modes = {int(step): mode for step, mode in record["modes"].items()}
        # JSON keys are strings; layer indices are ints in a live run
        self.history = [{**r, "per_layer": {int(k): v for k, v in r["per_layer"].items()}} for r in record["history"]]
        log = Path(checkpoint).parent / "sparsity.jsonl"
        if is_world_process_zero and (self.history or log.exists()):
            log.write_text("".join(json.dumps(r) + "\n" for r in self.history))

    def save(self, checkpoint: Path) -> None:
        """Write the record into a checkpoint; replace() so a kill mid-write leaves no half file."""
        tmp = Path(checkpoint) / (SCHEDULE_FILE + ".tmp")
        tmp.write_text(json.dumps({"modes": self.modes, "history": self.history}))
        tmp.replace(Path(checkpoint) / SCHEDULE_FILE)

    def mode_at(self, step: int) -> str:
        return "full" if self.switch_step is not None and step >= self.switch_step else "moba"

    def set_mode(self, mode: str) -> None:
        if mode == "moba":
            if self.model.config._attn_implementation != "moba":
                apply(self.model, self.moba)
        elif self.model.config._attn_implementation != "sdpa":
            self.model.set_attn_implementation("sdpa")  # moba_config stays: the checkpoint keeps the setting

    def on_train_begin(self, args, state, control, **kwargs):
        self.set_mode(self.mode_at(state.global_step))

    def on_step_begin(self, args, state, control, **kwargs):
        step = state.global_step
        mode = self.mode_at(step)
        if step > 0 and mode != self.modes.get(step - 1, mode):
            logger.warning("moba_hf: step %d: switching attention %s -> %s", step, self.modes[step - 1], mode)
        self.set_mode(mode)
        self.modes[step] = mode
        if mode == "moba" and self.sparsity_every and step % self.sparsity_every == 0:
            self._tracking = contextlib.ExitStack()
            self._stats = self._tracking.enter_context(track_sparsity())

    def on_step_end(self, args, state, control, **kwargs):
        if self._tracking is None:
            return
        self._tracking.close()
        per_layer = self._stats.per_layer()
        record = {
            "step": state.global_step - 1,
            "overall": self._stats.overall,
            "per_layer": per_layer,
            "backends": sorted(set(self._stats.backends.values())),
        }
        self.history.append(record)
        if state.is_world_process_zero:
            logger.warning(
                "moba_hf: step %d measured sparsity %.3f (per layer: %s)",
                record["step"],
                record["overall"],
                " ".join(f"{v:.2f}" for v in per_layer.values()),
            )
            out = Path(args.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "sparsity.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        self._tracking = self._stats = None

    def on_train_end(self, args, state, control, **kwargs):
        if self._tracking is not None:
            self._tracking.close()
            self._tracking = None
