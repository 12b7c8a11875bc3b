"""Resume: a run stopped after a checkpoint and resumed logs the losses of an uninterrupted run, bit for bit
(weights, Adam state, scheduler, RNG, data order and the MoBA / full phase all come back); Ctrl-C during
`moba-hf train` exits 130 with one line and leaves a checkpoint that resumes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import train_model
from test_train import WhatRan, tiny_config, tiny_dataset
from test_train_distributed import ROOT, write_run
from transformers import TrainerCallback

from moba_hf.train import train
from moba_hf.train.cli import load_config
from moba_hf.train.trainer import build_trainer, last_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


class Stop(Exception):
    pass


class StopAfterSave(TrainerCallback):
    """Kills the run right after the checkpoint of `step` is written."""

    def __init__(self, step):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise Stop


def test_resumed_run_equals_an_uninterrupted_one(tmp_path):
    # 6 Adam steps over shuffled rows, MoBA for steps 0-2 then full; checkpoints at 2 and 4, stopped at 4
    sections = {"schedule": {"moba_fraction": 0.5}, "train": {"max_steps": 6, "save_steps": 2, "sparsity_every": 2}}
    whole = train(tiny_config(tmp_path / "whole", **sections), model=train_model(), dataset=tiny_dataset())

    config = tiny_config(tmp_path / "cut", **sections)
    with pytest.raises(Stop):
        train(config, model=train_model(), dataset=tiny_dataset(), callbacks=[StopAfterSave(4)])
    assert last_checkpoint(config.train.output_dir).name == "checkpoint-4"
    probe = WhatRan()
    # other initial weights: the checkpoint's must replace them
    resumed = train(config, model=train_model(seed=1), dataset=tiny_dataset(), callbacks=[probe], resume=True)

    assert resumed.resumed_from.name == "checkpoint-4"
    assert resumed.losses == whole.losses and len(whole.losses) == 6  # exact: the same arithmetic in order
    assert probe.ran == {4: "full", 5: "full"}  # the resumed run starts in the full-attention phase
    assert resumed.modes == whole.modes == {s: "moba" if s < 3 else "full" for s in range(6)}
    assert resumed.sparsity == whole.sparsity and [r["step"] for r in whole.sparsity] == [0, 2]
    logged = (tmp_path / "cut" / "out" / "sparsity.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in logged] == [0, 2]


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no whole checkpoint .* train.save_steps > 0"):
        train(tiny_config(tmp_path), model=train_model(), dataset=tiny_dataset(), resume=True)


def test_ctrl_c_during_a_checkpoint_write_waits_for_it(tmp_path):
    config = tiny_config(tmp_path, train={"max_steps": 4, "save_steps": 2})
    trainer, _ = build_trainer(config, model=train_model(), dataset=tiny_dataset())
    save_model = trainer.save_model

    def save_model_under_ctrl_c(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # as the weights of checkpoint-2 start to be written
        return save_model(*args, **kwargs)

    trainer.save_model = save_model_under_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    checkpoint = last_checkpoint(config.train.output_dir)
    assert checkpoint is not None and checkpoint.name == "checkpoint-2"
    names = {p.name for p in checkpoint.iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "attention_schedule.json"} <= names


@pytest.mark.slow  # a fresh process imports torch + transformers
def test_ctrl_c_exits_130_and_leaves_a_resumable_checkpoint(tmp_path):
    run = write_run(tmp_path, max_steps=5000, save_steps=2, optim='"adamw_torch"', learning_rate=3e-3)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "moba_hf.cli", "train", str(run), "--output-dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while last_checkpoint(out) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    checkpoint = last_checkpoint(out)
    last = stderr.strip().splitlines()[-1]
    assert last == f"moba-hf train: interrupted; the last checkpoint is {checkpoint}; continue with --resume"

    step = json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]
    config = load_config(str(run), [], {("train", "output_dir"): str(out), ("train", "max_steps"): step + 2})
    resumed = train(config, resume=True)
    assert resumed.resumed_from == checkpoint
    assert len(resumed.losses) == step + 2 and all(torch.isfinite(torch.tensor(resumed.losses)))
