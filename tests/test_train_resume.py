"""Resume: a run stopped after a checkpoint and resumed logs the losses of an uninterrupted run, bit for bit
(weights, Adam state, scheduler, RNG, data order and the MoBA / full phase all come back); Ctrl-C during
`moba-hf train` exits 130 with one line and leaves a checkpoint that resumes."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_train import WhatRan, tiny_config, tiny_dataset
from test_train_distributed import ROOT, write_run
from tiny_models import train_model
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
        train(tiny_config(tmp_path / "new"), model=train_model(), dataset=tiny_dataset(), resume=True)
    assert list(tmp_path.iterdir()) == []  # the directories made for the run's lock are removed again


@pytest.fixture
def sigint_handled():
    """SIGINT raises KeyboardInterrupt, as in a terminal, even where pytest runs with it ignored (background)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("sigint_handled")
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


def test_a_run_with_sigint_ignored_keeps_ignoring_it_while_a_checkpoint_is_written(tmp_path):
    # a run started in the background (nohup, `&` in a script) inherits SIGINT ignored: it must not stop on one
    config = tiny_config(tmp_path, train={"max_steps": 4, "save_steps": 2})
    trainer, _ = build_trainer(config, model=train_model(), dataset=tiny_dataset())
    save_model = trainer.save_model
    seen = []

    def save_model_under_sigint(*args, **kwargs):
        seen.append(signal.getsignal(signal.SIGINT))
        os.kill(os.getpid(), signal.SIGINT)
        return save_model(*args, **kwargs)

    trainer.save_model = save_model_under_sigint
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        trainer.train()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    except KeyboardInterrupt:
        pytest.fail("the run stopped on a SIGINT it was started to ignore")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [signal.SIG_IGN, signal.SIG_IGN]  # checkpoints 2 and 4, written with SIGINT still ignored
    assert last_checkpoint(config.train.output_dir).name == "checkpoint-4"


@pytest.mark.slow  # a fresh process imports torch + transformers
def test_ctrl_c_exits_130_and_leaves_a_resumable_checkpoint(tmp_path):
    run = write_run(tmp_path, max_steps=5000, save_steps=2, optim='"adamw_torch"', learning_rate=3e-3)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "moba_hf.cli", "train", str(run), "--output-dir", str(out)]
    # faulthandler: a child that does not stop is aborted and prints where each of its threads was
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1")
    log = tmp_path / "stderr.txt"  # files, not pipes nobody reads while the run trains: a full pipe would block it
    with open(log, "w") as err, open(tmp_path / "stdout.txt", "w") as out_file:
        # Ctrl-C in a terminal: SIGINT handled, even where pytest itself runs with it ignored (in the background)
        default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
        proc = subprocess.Popen(cmd, env=env, stdout=out_file, stderr=err, preexec_fn=default_sigint)
        deadline = time.monotonic() + 120
        while last_checkpoint(out) is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=60)
            pytest.fail(f"no exit within 60 s of SIGINT; the run's threads then:\n{log.read_text()[-6000:]}")
    stderr = log.read_text()
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


def stopped_run(tmp_path, name="run", stop_at=4, **sections):
    """A run config (6 SGD steps, checkpoints every 2) stopped after its checkpoint at `stop_at`."""
    base = {"train": {"max_steps": 6, "save_steps": 2, "optim": "sgd", "learning_rate": 0.05, "save_total_limit": 0}}
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    config = tiny_config(tmp_path / name, **base)
    with pytest.raises(Stop):
        train(config, model=train_model(), dataset=tiny_dataset(), callbacks=[StopAfterSave(stop_at)])
    return config


def test_a_changed_config_on_resume_is_refused_naming_each_key(tmp_path):
    config = stopped_run(tmp_path)
    out = config.train.output_dir
    state = (last_checkpoint(out) / "trainer_state.json").read_text()
    changed = config.replace("moba", block_size=16).replace("train", learning_rate=0.01)
    with pytest.raises(ValueError) as err:
        train(changed, model=train_model(), dataset=tiny_dataset(), resume=True)
    message = str(err.value)
    assert message.startswith(f"resume from {out}/checkpoint-4: the config differs from the run that wrote")
    assert "moba.block_size: 8 -> 16; train.learning_rate: 0.05 -> 0.01." in message
    assert "--allow-config-change" in message
    with pytest.raises(ValueError, match=r"data.fingerprint: '[0-9a-f]{16}' -> '[0-9a-f]{16}'"):
        train(config, model=train_model(), dataset=tiny_dataset(n_docs=30), resume=True)  # other rows
    with pytest.raises(ValueError, match=r"data.fingerprint: .*; data.seq_len: 1024 -> 32"):
        train(config.replace("data", seq_len=32), model=train_model(), dataset=tiny_dataset(seq_len=32), resume=True)
    # refused before a step: the checkpoint and the run are as they were
    assert last_checkpoint(out).name == "checkpoint-4"
    assert (last_checkpoint(out) / "trainer_state.json").read_text() == state
    # what resume may change freely: the step count (the switch step is compared instead), logging, saving
    more = config.replace("train", max_steps=7, logging_steps=2, save_steps=3)
    assert train(more, model=train_model(), dataset=tiny_dataset(), resume=True).resumed_from.name == "checkpoint-4"


def test_a_switch_step_moved_by_max_steps_is_a_change(tmp_path):
    config = stopped_run(tmp_path, schedule={"moba_fraction": 0.5})  # switch at step 3 of 6
    with pytest.raises(ValueError, match=r"schedule.switch_step: 3 -> 4"):
        train(config.replace("train", max_steps=8), model=train_model(), dataset=tiny_dataset(), resume=True)


def parameters(path):
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def test_allowed_changes_apply_and_are_recorded(tmp_path):
    """An SGD step moves a weight by -lr x (clipped gradient + weight_decay x weight); the gradient at step 5
    depends only on the checkpoint's weights and the batch, so a resume at twice the learning rate moves every
    weight twice as far, and a weight decay wd adds -lr x wd x weight (to the decay group only). Both runs round
    each weight once: the deltas agree within 2 ulp of the weight (atol 2 eps max|w|)."""
    import shutil

    config = stopped_run(tmp_path, stop_at=4)
    out = tmp_path / "run" / "out"
    runs = {}
    for name, changes in {"same": {}, "lr": {"learning_rate": 0.1}, "wd": {"weight_decay": 0.5}}.items():
        shutil.copytree(out, tmp_path / name / "out")
        run = config.replace("train", output_dir=str(tmp_path / name / "out"), max_steps=5, **changes)
        probe = LearningRates()
        result = train(
            run,
            model=train_model(),
            dataset=tiny_dataset(),
            callbacks=[probe],
            resume=True,
            allow_config_change=bool(changes),
        )
        assert result.resumed_from.name == "checkpoint-4"
        runs[name] = (parameters(tmp_path / name / "out" / "checkpoint-5"), probe.lrs)
    before = parameters(out / "checkpoint-4")
    assert runs["same"][1] == {4: 0.05} and runs["lr"][1] == {4: 0.1} and runs["wd"][1] == {4: 0.05}
    eps = torch.finfo(torch.float32).eps
    decayed = 0
    for key, w in before.items():
        same, lr, wd = (runs[name][0][key] - w for name in ("same", "lr", "wd"))
        atol = 2 * eps * w.abs().max().item()
        assert same.abs().max() > 50 * atol, key  # every tensor moves well past the rounding
        torch.testing.assert_close(lr, 2 * same, rtol=0, atol=2 * atol, msg=key)
        expected = same - 0.05 * 0.5 * w if "norm" not in key else same  # norms are in the no-decay group
        torch.testing.assert_close(wd, expected, rtol=0, atol=atol, msg=key)
        decayed += "norm" not in key
    assert decayed > 0

    record = json.loads((tmp_path / "lr" / "out" / "run_config.json").read_text())
    steps = {"train.max_steps": [6, 5]}  # free to change, recorded
    entry = {"step": 4, "checkpoint": "checkpoint-4", "changes": {"train.learning_rate": [0.05, 0.1], **steps}}
    assert record["config_changes"] == [entry]
    assert json.loads((tmp_path / "lr" / "out" / "checkpoint-5" / "run_config.json").read_text()) == record
    summary = json.loads((tmp_path / "lr" / "out" / "train_summary.json").read_text())
    assert summary["config_changes"] == [entry]
    logged = [e["learning_rate"] for e in summary_log(tmp_path / "lr" / "out" / "checkpoint-5")]
    assert logged == [0.05] * 4 + [0.1]  # what the Trainer logs for each step
    same = json.loads((tmp_path / "same" / "out" / "run_config.json").read_text())["config_changes"]
    assert same == [{"step": 4, "checkpoint": "checkpoint-4", "changes": steps}]


def summary_log(checkpoint):
    return [e for e in json.loads((checkpoint / "trainer_state.json").read_text())["log_history"] if "loss" in e]


class LearningRates(TrainerCallback):
    """Probe: the learning rate the optimizer steps with, per optimizer step."""

    def __init__(self):
        self.lrs = {}

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.lrs[state.global_step] = optimizer.param_groups[0]["lr"]


def test_what_a_checkpoint_fixes_is_refused_even_when_allowed(tmp_path):
    config = stopped_run(tmp_path)
    for section, key, value in [("train", "optim", "adamw_torch"), ("train", "seed", 1), ("lora", "r", 4)]:
        changed = config.replace(section, **{key: value})
        with pytest.raises(ValueError, match=rf"cannot change on resume: {section}.{key}: .* -> {value!r} \("):
            train(changed, model=train_model(), dataset=tiny_dataset(), resume=True, allow_config_change=True)


def corrupt(path, how):
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        path.write_text('{"global_step": 6, "log_hist')


@pytest.mark.parametrize(
    ("name", "how", "why"),
    [
        ("model.safetensors", "truncate", r"model.safetensors is truncated \(\d+ bytes; its header describes \d+\)"),
        ("trainer_state.json", "garbage", r"trainer_state.json is not valid JSON"),
        ("optimizer.pt", "truncate", r"optimizer.pt is truncated or corrupt"),
        ("rng_state.pth", "truncate", r"rng_state.pth is truncated or corrupt"),
        ("run_config.json", "garbage", r"run_config.json is not valid JSON"),
    ],
)
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog, name, how, why):
    whole = train(
        tiny_config(tmp_path / "whole", train={"max_steps": 6, "optim": "sgd", "learning_rate": 0.05}),
        model=train_model(),
        dataset=tiny_dataset(),
    )
    config = stopped_run(tmp_path, stop_at=6)
    out = config.train.output_dir
    corrupt(last_checkpoint(out) / name, how)
    with caplog.at_level("WARNING", logger="moba_hf"):
        resumed = train(config, model=train_model(seed=1), dataset=tiny_dataset(), resume=True)
    assert resumed.resumed_from.name == "checkpoint-4"
    skipped = [m for m in caplog.messages if "skipping" in m]
    assert len(skipped) == 1 and re.fullmatch(rf"moba_hf: resume: skipping {out}/checkpoint-6: {why}.*", skipped[0])
    assert resumed.losses == whole.losses  # steps 5 and 6 rerun from checkpoint-4 exactly


def test_no_whole_checkpoint_is_refused_naming_each_file(tmp_path):
    config = stopped_run(tmp_path)
    out = config.train.output_dir
    corrupt(last_checkpoint(out) / "model.safetensors", "truncate")
    corrupt(last_checkpoint(out).parent / "checkpoint-2" / "trainer_state.json", "garbage")
    with pytest.raises(ValueError) as err:
        train(config, model=train_model(), dataset=tiny_dataset(), resume=True)
    assert str(err.value).startswith(
        f"resume: no whole checkpoint in {out}: checkpoint-4: model.safetensors is truncated"
    )
    assert "; checkpoint-2: trainer_state.json is not valid JSON" in str(err.value)


def test_a_checkpoint_without_its_run_record_is_refused_unless_allowed(tmp_path):
    config = stopped_run(tmp_path)
    checkpoint = last_checkpoint(config.train.output_dir)
    (checkpoint / "run_config.json").unlink()
    with pytest.raises(ValueError, match=rf"^resume from {checkpoint}: the checkpoint has no run_config.json, so"):
        train(config, model=train_model(), dataset=tiny_dataset(), resume=True)
    result = train(config, model=train_model(), dataset=tiny_dataset(), resume=True, allow_config_change=True)
    assert result.resumed_from == checkpoint
    record = json.loads((checkpoint.parent / "run_config.json").read_text())
    assert list(record["config_changes"][0]["changes"]) == ["run_config"]


def test_a_missing_optimizer_state_is_refused_unless_allowed(tmp_path, caplog):
    config = stopped_run(tmp_path)
    checkpoint = last_checkpoint(config.train.output_dir)
    (checkpoint / "optimizer.pt").unlink()
    with pytest.raises(ValueError, match=rf"^resume from {checkpoint}: {checkpoint}/optimizer.pt missing, so the"):
        train(config, model=train_model(), dataset=tiny_dataset(), resume=True)
    with caplog.at_level("WARNING", logger="moba_hf"):
        result = train(config, model=train_model(), dataset=tiny_dataset(), resume=True, allow_config_change=True)
    assert result.resumed_from == checkpoint and len(result.losses) == 6
    assert any("optimizer_state changed on resume" in m for m in caplog.messages), caplog.messages
    record = json.loads((checkpoint.parent / "run_config.json").read_text())
    assert record["config_changes"][0]["changes"] == {
        "optimizer_state": ["checkpoint-4/optimizer.pt", "fresh (files missing)"]
    }


def test_cli_resume_refuses_a_changed_config_and_records_an_allowed_one(tmp_path, capsys):
    from moba_hf.cli import main

    run = write_run(tmp_path, max_steps=4, save_steps=2)
    out = tmp_path / "out"
    assert main(["train", str(run), "--output-dir", str(out)]) == 0
    capsys.readouterr()
    args = ["train", str(run), "--output-dir", str(out), "--resume", "--max-steps", "6", "--set", "moba.block_size=16"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the weights' loading bar: one line
    assert err.startswith(f"moba-hf train: error: resume from {out}/checkpoint-4: the config differs")
    assert "moba.block_size: 8 -> 16." in err
    assert last_checkpoint(out).name == "checkpoint-4"
    assert main([*args, "--allow-config-change"]) == 0
    assert last_checkpoint(out).name == "checkpoint-6"
    record = json.loads((out / "run_config.json").read_text())
    assert record["config"]["moba"]["block_size"] == 16
    assert record["config_changes"] == [
        {"step": 4, "checkpoint": "checkpoint-4", "changes": {"moba.block_size": [8, 16], "train.max_steps": [4, 6]}}
    ]


# --- a finished run -----------------------------------------------------------------------------------------


def snapshot(directory):
    """Every file under `directory`: its bytes and modification time."""
    return {
        p.relative_to(directory).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def finished_run(tmp_path, **train_keys):
    """A whole 4-step SGD run with checkpoints at 2 and 4 and the final model saved."""
    keys = {"max_steps": 4, "save_steps": 2, "optim": "sgd", "learning_rate": 0.05, "save": True, **train_keys}
    config = tiny_config(tmp_path, train=keys)
    train(config, model=train_model(), dataset=tiny_dataset())
    return config


def test_resume_of_a_finished_run_trains_and_writes_nothing(tmp_path, caplog):
    config = finished_run(tmp_path)
    out = tmp_path / "out"
    before = snapshot(out)
    for _ in range(3):  # each re-run trained one more step and overwrote the saved model
        with caplog.at_level("WARNING", logger="moba_hf"):
            result = train(config, model=train_model(), dataset=tiny_dataset(), resume=True)
        assert result.finished_at == 4 and result.losses == [] and result.output_dir is None
        assert result.resumed_from == out / "checkpoint-4"
    assert snapshot(out) == before
    line = (
        f"moba_hf: {out} holds a finished run: checkpoint-4 is at step 4 and train.max_steps is 4; nothing to "
        "train (raise train.max_steps, --max-steps, to continue it)"
    )
    assert [m for m in caplog.messages if "finished" in m] == [line] * 3


def test_a_raised_max_steps_continues_a_finished_run_and_is_recorded(tmp_path):
    config = finished_run(tmp_path)
    out = tmp_path / "out"
    result = train(config.replace("train", max_steps=6), model=train_model(), dataset=tiny_dataset(), resume=True)
    assert result.resumed_from == out / "checkpoint-4" and result.finished_at is None
    assert len(result.losses) == 6 and last_checkpoint(out).name == "checkpoint-6"
    entry = {"step": 4, "checkpoint": "checkpoint-4", "changes": {"train.max_steps": [4, 6]}}
    assert json.loads((out / "run_config.json").read_text())["config_changes"] == [entry]
    assert json.loads((out / "checkpoint-6" / "run_config.json").read_text())["config_changes"] == [entry]
    assert json.loads((out / "train_summary.json").read_text())["config_changes"] == [entry]


def test_cli_resume_of_a_finished_run_says_so_in_one_line(tmp_path, capsys, caplog):
    from moba_hf.cli import main

    run = write_run(tmp_path, max_steps=2, save_steps=2)
    out = tmp_path / "out"
    assert main(["train", str(run), "--output-dir", str(out)]) == 0
    before = snapshot(out)
    capsys.readouterr()
    caplog.clear()
    with caplog.at_level("INFO", logger="moba_hf"):
        assert main(["train", str(run), "--output-dir", str(out), "--resume"]) == 0
    assert capsys.readouterr() == ("", "")  # the log line alone (on stderr, from the command's logging setup)
    assert caplog.messages == [
        f"moba_hf: {out} holds a finished run: checkpoint-2 is at step 2 and train.max_steps is 2; nothing to "
        "train (raise train.max_steps, --max-steps, to continue it)"
    ]
    assert snapshot(out) == before


# --- one output directory, one run --------------------------------------------------------------------------


class During(TrainerCallback):
    """Calls `action` once, at the end of optimizer step `step`."""

    def __init__(self, step, action):
        self.step, self.action, self.result = step, action, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.result = self.action()


def test_a_second_training_into_a_directory_in_use_is_refused(tmp_path):
    from moba_hf.train import RunRefused

    config = tiny_config(tmp_path, train={"max_steps": 4, "save_steps": 2, "sparsity_every": 1})
    out = tmp_path / "out"

    def second_run():
        with pytest.raises(RunRefused) as err:  # a new run, and a resume of the first, while it trains
            train(config, model=train_model(), dataset=tiny_dataset())
        with pytest.raises(RunRefused) as err_resume:
            train(config, model=train_model(), dataset=tiny_dataset(), resume=True)
        return str(err.value), str(err_resume.value)

    probe = During(3, second_run)
    first = train(config, model=train_model(), dataset=tiny_dataset(), callbacks=[probe])
    for message in probe.result:
        assert message.startswith(f"{out} is in use by another run (pid {os.getpid()} on ")
        assert f"holding {out}/run.lock): two trainings into one directory would mix" in message
    assert not (out / "run.lock").exists()  # released when the run ends
    logged = [json.loads(line)["step"] for line in (out / "sparsity.jsonl").read_text().splitlines()]
    assert logged == [0, 1, 2, 3] and [r["step"] for r in first.sparsity] == logged  # the first run's records only
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


def test_the_lock_is_released_on_an_exception_and_on_ctrl_c(tmp_path):
    def interrupt():
        raise KeyboardInterrupt

    config = tiny_config(tmp_path, train={"max_steps": 6, "save_steps": 2})
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        train(config, model=train_model(), dataset=tiny_dataset(), callbacks=[During(3, interrupt)])
    assert not (out / "run.lock").exists()
    with pytest.raises(Stop):
        train(config, model=train_model(), dataset=tiny_dataset(), callbacks=[StopAfterSave(4)], resume=True)
    assert not (out / "run.lock").exists()
    assert len(train(config, model=train_model(), dataset=tiny_dataset(), resume=True).losses) == 6


def test_a_stale_lock_of_a_killed_training_is_taken_over_with_a_log_line(tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    holder = "import sys\nfrom moba_hf.rundir import lock_dir\nlock_dir(sys.argv[1], why='')\n"
    holder += "print('ready', flush=True)\nsys.stdin.read()\n"
    child = subprocess.Popen([sys.executable, "-c", holder, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "ready"
    finally:
        child.kill()  # kill -9: run.lock stays behind with its pid
        child.wait(timeout=60)
    assert (out / "run.lock").read_text().startswith(f"{child.pid} on ")
    with caplog.at_level("WARNING", logger="moba_hf"):
        result = train(tiny_config(tmp_path, train={"max_steps": 2}), model=train_model(), dataset=tiny_dataset())
    assert len(result.losses) == 2 and not (out / "run.lock").exists()
    taken = [m for m in caplog.messages if "took over" in m]
    assert len(taken) == 1 and taken[0].startswith(f"moba_hf: {out}/run.lock: took over the lock of pid {child.pid} ")


@pytest.mark.parametrize("stopped", [True, False], ids=["partial", "finished"])
def test_a_new_run_into_a_directory_holding_another_run_is_refused(tmp_path, stopped):
    from moba_hf.train import RunRefused

    if stopped:
        config = stopped_run(tmp_path, train={"sparsity_every": 2})  # checkpoints 2 and 4 of 6
        out = tmp_path / "run" / "out"
    else:
        config = finished_run(tmp_path, sparsity_every=2)
        out = tmp_path / "out"
    before = snapshot(out)
    with pytest.raises(RunRefused) as err:
        train(config.replace("moba", block_size=16), model=train_model(), dataset=tiny_dataset())
    files = "run_config.json, sparsity.jsonl, checkpoint-2, checkpoint-4"
    files = files if stopped else files.replace("run_config.json", "run_config.json, train_summary.json")
    assert str(err.value) == (
        f"{out} holds another training run ({files}): a new run into it would replace its checkpoints and append to "
        "its records; continue it with --resume (train(..., resume=True)), give another output directory (--out, "
        "train.output_dir), or remove these files first"
    )
    assert snapshot(out) == before


# --- records read back --------------------------------------------------------------------------------------


def test_a_run_record_of_another_type_is_refused_naming_file_field_and_type(tmp_path):
    config = stopped_run(tmp_path)
    path = last_checkpoint(config.train.output_dir) / "run_config.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "config_changes": "none"}))  # list("none") became four changes
    with pytest.raises(ValueError) as err:
        train(config, model=train_model(), dataset=tiny_dataset(), resume=True)
    assert str(err.value) == (
        f"{path}: field 'config_changes' is \"none\" (a string), expected an array of objects (this package writes "
        "the file whole: it was edited since); restore it"
    )
    bad_change = {"step": "4", "checkpoint": "checkpoint-4", "changes": {}}
    path.write_text(json.dumps({**record, "config_changes": [bad_change]}))
    with pytest.raises(ValueError, match=r"config_changes\[0\]: field 'step' is \"4\" \(a string\), expected an int"):
        train(config, model=train_model(), dataset=tiny_dataset(), resume=True)


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda r: r["history"][1].update(overall="0.5"), "history[1]: field 'overall' is \"0.5\" (a string), "
                                                           "expected a number"),
        (lambda r: r["history"][0].update(step=0.0), "history[0]: field 'step' is 0.0 (a number), expected an integer"),
        (lambda r: r["modes"].update({"1": "sparse"}), 'modes has "1": "sparse", expected a step number: "moba" or '
                                                       '"full"'),
        (lambda r: r["history"][0].update(per_layer={"a": 0.5}), "history[0]: field 'per_layer' is {\"a\": 0.5}, "
                                                                 "expected layer numbers as keys"),
    ],
)  # fmt: skip
def test_an_attention_schedule_of_another_type_is_refused(tmp_path, edit, problem):
    config = stopped_run(tmp_path, train={"sparsity_every": 2})
    path = last_checkpoint(config.train.output_dir) / "attention_schedule.json"
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))
    before = snapshot(path.parent.parent)
    with pytest.raises(ValueError) as err:
        train(config, model=train_model(), dataset=tiny_dataset(), resume=True)
    assert str(err.value) == f"{path}: {problem} (this package writes the file whole: it was edited since)"
    assert snapshot(path.parent.parent) == before  # refused before anything is written
