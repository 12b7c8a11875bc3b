"""DDP and FSDP2 through the Trainer, no custom communication: 2 CPU processes (gloo) x batch 1 give the losses
and weights of 1 process x batch 2 on the same rows, and packed rows stay within their documents when sharded.

Tolerances follow from float32 arithmetic. The runs differ only in summation order: the loss mean and each
weight gradient reduce over N = 2 rows x 64 tokens, summed in one batch here and per rank then across ranks
there. Recursive summation of n terms errs by at most n * eps of the sum of magnitudes, so losses get
rtol = N * eps. The optimizer is SGD: a parameter then differs by lr x (gradient difference) per step, with
every gradient element at most max_grad_norm = 1 after clipping, so parameters get atol = steps * lr * N * eps.
(Adam divides by sqrt(v): a near-zero gradient element whose sign differs moves by up to 2 lr, so no float
tolerance bounds Adam's weights.) A real bug (gradients left unaveraged, two ranks on the same rows) lands
orders of magnitude beyond these bounds (docs/training.md has the measured numbers).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import train_model
from transformers import AutoModelForCausalLM

from moba_hf.train.cli import load_config
from moba_hf.train.trainer import train

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]  # fresh processes import torch

ROOT = Path(__file__).parent.parent
EPS = torch.finfo(torch.float32).eps
ROWS, SEQ_LEN, STEPS, LR = 2, 64, 3, 1.0  # SGD's step is lr x the clipped gradient (norm <= 1)
N = ROWS * SEQ_LEN  # terms of each reduction that the two runs order differently
LOSS_RTOL = N * EPS
PARAM_ATOL = STEPS * LR * 1.0 * N * EPS  # 1.0 = max_grad_norm


def write_run(tmp_path: Path, **train_keys) -> Path:
    """A tiny saved Llama, 24 token-id documents and a run config over them: (path of the config)."""
    train_model().save_pretrained(tmp_path / "model")
    g = torch.Generator().manual_seed(0)
    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(24):
            n = int(torch.randint(20, 70, (1,), generator=g))
            f.write(json.dumps({"input_ids": ((torch.arange(n) * (i % 5 + 1)) % 128).tolist()}) + "\n")
    keys = {
        "max_steps": STEPS,
        "batch_size": 1,
        "optim": '"sgd"',
        "learning_rate": LR,
        "shuffle": "false",
        "sparsity_every": 0,
        **train_keys,
    }
    path = tmp_path / "run.toml"
    path.write_text(
        f'[model]\nname = "{tmp_path / "model"}"\n[moba]\nblock_size = 8\ntop_k = 2\n'
        f'[data]\nsource = "{tmp_path / "data.jsonl"}"\nseq_len = {SEQ_LEN}\n'
        "[train]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())
    )
    return path


def launch(launcher: list[str], *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `launcher` (torchrun / accelerate launch, 2 processes) on `args`; one thread per process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([*launcher, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
ACCELERATE_FSDP = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
ACCELERATE_FSDP += [str(ROOT / "configs" / "accelerate_fsdp.yaml"), "--num_processes", "2"]


def train_two_processes(tmp_path: Path, launcher: list[str], run: Path) -> dict:
    launch(launcher, "-m", "moba_hf.cli", "train", str(run), "--output-dir", str(tmp_path / "two"))
    return json.loads((tmp_path / "two" / "train_summary.json").read_text())


def train_one_process(tmp_path: Path, run: Path):
    overrides = [f"train.batch_size={ROWS}"]
    return train(load_config(str(run), overrides, {("train", "output_dir"): str(tmp_path / "one")}))


def assert_same_training(tmp_path: Path, two: dict, one) -> None:
    assert len(two["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one.losses), rtol=LOSS_RTOL, atol=0)
    weights = load_file(tmp_path / "two" / "model.safetensors")
    reference = load_file(tmp_path / "one" / "model.safetensors")
    assert weights.keys() == reference.keys()
    for name, w in reference.items():
        torch.testing.assert_close(weights[name], w, rtol=0, atol=PARAM_ATOL, msg=lambda m, name=name: f"{name}: {m}")
    start = load_file(tmp_path / "model" / "model.safetensors")
    moved = min((reference[name] - start[name]).abs().max() for name in reference)
    assert moved > 10 * PARAM_ATOL, moved  # every tensor moves far more than the bound allows for rounding


def test_two_process_ddp_matches_one_process(tmp_path):
    run = write_run(tmp_path)
    two = train_two_processes(tmp_path, TORCHRUN, run)
    assert (two["distributed"], two["num_processes"]) == ("MULTI_CPU", 2)
    assert_same_training(tmp_path, two, train_one_process(tmp_path, run))


def test_two_process_fsdp2_matches_one_process(tmp_path):
    """`accelerate launch --config_file configs/accelerate_fsdp.yaml`: FSDP2 with MoBA, switching to full
    attention for the last step; the saved full state dict reloads as the one-process model."""
    run = write_run(tmp_path)
    run.write_text(run.read_text() + "[schedule]\nmoba_fraction = 0.67\n")  # MoBA for steps 0, 1; full for 2
    two = train_two_processes(tmp_path, ACCELERATE_FSDP, run)
    assert (two["distributed"], two["num_processes"]) == ("FSDP", 2)
    one = train_one_process(tmp_path, run)
    assert two["modes"] == {str(s): m for s, m in one.modes.items()} == {"0": "moba", "1": "moba", "2": "full"}
    assert_same_training(tmp_path, two, one)
    saved = json.loads((tmp_path / "two" / "config.json").read_text())
    assert saved["moba_config"] == load_config(str(run)).moba.to_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "two", attn_implementation="moba")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "one", attn_implementation="moba")
    assert reloaded.config.moba_config == saved["moba_config"]
    for (name, p), q in zip(reloaded.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=PARAM_ATOL, msg=lambda m, name=name: f"{name}: {m}")


def test_packed_rows_stay_in_their_documents_under_ddp_and_fsdp2():
    """The packing probe of test_train_data, on 2 processes, the model in DDP and sharded by fully_shard."""
    done = launch(TORCHRUN, str(ROOT / "tests" / "test_train_data.py"), "--distributed")
    assert done.stdout.count("probe passed under DDP and FSDP2") == 2, done.stdout[-2000:]
