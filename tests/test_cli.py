"""The `moba-hf` command line: one vocabulary, one-line errors before any model loads, Ctrl-C, the demo."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from moba_hf import cli, cli_args, models

pytestmark = pytest.mark.usefixtures("one_thread")


def run(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as done:  # argparse errors and --version
        return done.code


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: bad values must be refused before."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", refuse)


def test_lengths_vocabulary():
    assert cli_args.parse_lengths("1K,2k,4096, 1.5K") == [1024, 2048, 4096, 1536]
    assert cli_args.parse_lengths("1M") == [1024 * 1024]
    for bad in ("0", "-5", "big", "0.5", "1.3", "", "K"):
        with pytest.raises(argparse.ArgumentTypeError, match="token counts >= 1|at least one"):
            cli_args.parse_lengths(bad)


def test_version(capsys):
    assert run(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "moba-hf 0.1.0"


@pytest.mark.parametrize(
    "argv", [["--help"], ["eval", "passkey", "--help"], ["eval", "sweep", "--help"], ["demo", "-h"]]
)
def test_help_loads_no_machinery(argv):
    code = (
        f"import sys; from moba_hf import cli\ntry: cli.main({argv!r})\nexcept SystemExit: print(sorted(sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    heavy_modules = ("torch", "transformers", "tqdm", "datasets", "moba_hf.eval.grid", "moba_hf.eval.run_store")
    for heavy in (*heavy_modules, "moba_hf.train"):
        assert f"'{heavy}'" not in loaded


def test_every_eval_command_shares_the_vocabulary():
    parser = cli.build_parser()
    for task in ("passkey", "niah", "ppl", "sweep"):
        args = parser.parse_args(["eval", task, "--lengths", "2K", "--attn", "b64-k12-f3"])
        assert args.out == f"runs/{task}" and args.lengths == [2048] and args.attn == ["b64-k12-f3"]
        assert args.model == "smollm2" and args.dtype == "auto" and args.device == "auto"
    for task in ("niah", "ppl", "sweep"):
        assert parser.parse_args(["eval", task, "--text", "t.txt"]).text == "t.txt"
    assert parser.parse_args(["eval", "niah", "--haystack", "t.txt"]).text == "t.txt"  # an alias of --text
    assert parser.parse_args(["eval", "lm-eval-data"]).out == "runs/lm-eval-data"
    assert parser.parse_args(["demo", "--lengths", "2K,4K"]).lengths == [2048, 4096]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["eval", "passkey", "--lengths", "0"], "--lengths"),
        (["eval", "passkey", "--lengths", "-5"], "--lengths"),
        (["eval", "niah", "--trials", "0"], "--trials"),
        (["eval", "sweep", "--batch", "0"], "--batch"),
        (["eval", "ppl", "--stride", "0"], "--stride"),
        (["eval", "passkey", "--depths", "1.5"], "--depths"),
        (["demo", "--lengths", "0"], "--lengths"),
        (["demo", "--trials", "0"], "--trials"),
        (["dca-matrix", "--seq-len", "0"], "--seq-len"),
    ],
)
def test_bad_values_are_one_line_and_exit_2(argv, flag, capsys, no_model):
    assert run(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and flag in err and "error" in err


def test_bad_values_found_after_parsing_exit_2_before_the_model_loads(tiny_dir, tmp_path, capsys, no_model):
    model = ["--model", str(tiny_dir)]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    short = tmp_path / "short.txt"
    short.write_text("Too short for two thousand tokens.")
    cases = [
        (["eval", "passkey", "--out", str(a_file)], "--out", "is a file"),
        (["eval", "ppl", "--out", str(a_file / "sub")], "--out", "is a file"),
        (["eval", "passkey", "--model", str(tmp_path / "missing")], "--model", "no such directory"),
        (["eval", "passkey", "--model", str(tmp_path)], "--model", "no config.json"),
        (["eval", "passkey", *model, "--attn", "moba:no-such-preset"], "--attn", "training-free"),
        (["eval", "passkey", *model, "--lengths", "20"], "--lengths", "passkey prompt"),
        (["eval", "ppl", *model, "--text", str(short), "--lengths", "2K"], "--text", "2048"),
        (["eval", "ppl", *model, "--lengths", "64", "--mode", "sliding", "--stride", "64"], "--stride", "63"),
        (["eval", "sweep", *model, "--text", str(short), "--lengths", "128", "--ppl-length", "1K"], "--text", "1024"),
        (["eval", "sweep", *model, "--only", "b1-k1-f1"], "--only", "b64-k12-f3"),
        (["eval", "niah", *model, "--needle", "No placeholder."], "--answer", "placeholder"),
        (["eval", "niah", *model, "--lengths", "16"], "--lengths", "needle"),
        (["demo", *model, "--attn", "moba:nope"], "--attn", "preset"),
        (["demo", "--model", str(tmp_path / "missing")], "--model", "no such directory"),
    ]
    for argv, flag, why in cases:
        assert run([*argv, "--out", str(tmp_path / "out")] if "--out" not in argv and argv[0] == "eval" else argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and flag in err and why in err, (argv, err)
    assert not (tmp_path / "out").exists()


def test_ctrl_c_is_one_line_exit_130_and_the_run_resumes(tiny_dir, tmp_path, capsys, monkeypatch):
    import moba_hf.eval.passkey as passkey

    decode = passkey.greedy_decode
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return decode(*args, **kwargs)

    monkeypatch.setattr(passkey, "greedy_decode", interrupted)
    out = tmp_path / "pk"
    argv = ["eval", "passkey", "--model", str(tiny_dir), "--lengths", "64", "--depths", "0,1", "--trials", "2",
            "--max-new-tokens", "2", "--out", str(out), "--no-progress"]  # fmt: skip
    assert run(argv) == 130
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "interrupted" in err.splitlines()[-1] and str(out) in err.splitlines()[-1]
    assert sorted(p.name for p in out.iterdir()) == ["run.json", "trials.jsonl"]  # nothing half-written
    assert len([json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]) == 2
    monkeypatch.setattr(passkey, "greedy_decode", decode)
    assert run(argv) == 0
    assert len((out / "trials.jsonl").read_text().splitlines()) == 4


def test_demo_warms_up_alternates_and_averages_sparsity(tiny_dir, monkeypatch):
    import moba_hf.eval.passkey as passkey
    from moba_hf.demo import run_demo, table
    from moba_hf.eval.settings import parse_setting

    model, tokenizer = models.load_model(str(tiny_dir), device="cpu")
    order, forwards = [], []
    model.register_forward_pre_hook(lambda module, args, kwargs: forwards.append(order[:]), with_kwargs=True)
    sparsities = iter([0.2, 0.6, 0.3, 0.5])

    def trial(model, tokenizer, length, depth, key, max_new_tokens=8):
        moba = model.config._attn_implementation == "moba"
        order.append("moba" if moba else "sdpa")
        return passkey.PasskeyTrial(length, depth, key, key, True, length, 2.0 if moba else 1.0, "", next(sparsities)
                                    if moba else 0.0)  # fmt: skip

    monkeypatch.setattr(passkey, "run_trial", trial)
    moba = parse_setting("moba:block_size=16,top_k=2")
    rows = run_demo(model, tokenizer, moba, [128, 256], 2, progress=False)
    assert order == ["sdpa", "moba"] * 4  # one prompt, both settings back to back
    assert forwards == [[], []]  # two untimed warm-up forwards before the first timed trial
    assert [r["moba_sparsity"] for r in rows] == [pytest.approx(0.4), pytest.approx(0.4)]  # means, not last trial
    assert "| 0.50x | 0.40 |" in table(rows)


def test_demo_command_on_a_local_checkpoint(tiny_dir, capsys):
    argv = ["demo", "--model", str(tiny_dir), "--lengths", "128", "--trials", "1", "--attn", "b16=moba:block_size=16"]
    assert run(argv) == 0
    out = capsys.readouterr().out
    assert "MoBA: MobaConfig(block_size=16, top_k=3) (setting b16)" in out
    assert "| moba speed-up (higher = faster) | moba sparsity |" in out
    assert run([*argv[:-1], "moba:full_attn_layers=9"]) == 2  # the tiny model has 2 layers
    assert "--attn moba(full_attn_layers=9): full_attn_layers=9 exceeds" in capsys.readouterr().err


@pytest.fixture
def no_training(monkeypatch):
    """Any training or lm-eval run fails the test: mistakes must be refused before."""
    import moba_hf.eval.harness as harness
    import moba_hf.train.trainer as trainer

    def refuse(*args, **kwargs):
        raise AssertionError("work started")

    monkeypatch.setattr(trainer, "train", refuse)
    monkeypatch.setattr(harness, "run_lm_eval", refuse)


def test_mistakes_are_one_line_before_any_work(tiny_dir, tmp_path, capsys, no_model, no_training, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # refused without asking the hub, online too
    config = tmp_path / "train.toml"
    config.write_text('[model]\nname = "smollm2"\n')
    (tmp_path / "runs").mkdir()
    model = ["--model", str(tiny_dir)]
    out = tmp_path / "out"
    cases = [
        (["train", str(tmp_path / "missing.toml")], "moba-hf train: error: config file not found"),
        (["train", str(config), "--model", "smollm3"], "--model smollm3: no such directory, embedded name or hub id; "
         "did you mean smollm2?"),  # fmt: skip
        (["train", str(config), "--model", "runs/missing"], "--model runs/missing: no such directory"),
        (["eval", "passkey", "--model", "smollm3", "--out", str(out)], "did you mean smollm2?"),
        (["eval", "passkey", "--model", "SmolLM2", "--out", str(out)], "did you mean smollm2?"),
        (["eval", "passkey", "--model", "runs/ckpt", "--out", str(out)], "--model runs/ckpt: no such directory"),
        (["eval", "passkey", *model, "--attn", "sdpaa", "--out", str(out)], "--attn: unknown attention 'sdpaa'; "
         "did you mean 'sdpa'?"),  # fmt: skip
        (["eval", "sweep", *model, "--attn", "b64-k12-f4", "--out", str(out)], "did you mean 'b64-k12-f3'?"),
        (["eval", "passkey", *model, "--attn", "moba:trainingfree", "--out", str(out)], "did you mean 'training-free'"),
        (["eval", "passkey", "--lenghts", "2K"], "moba-hf eval passkey: error: unrecognized arguments: --lenghts 2K; "
         "did you mean --lengths? (see moba-hf eval passkey --help)"),  # fmt: skip
        (["train", str(config), "--max-step", "2", "--sett", "a.b=1"], "did you mean --set? (see moba-hf train --help"),
        (["presets", "trainingfree"], "did you mean 'training-free'?"),
        (["lm-eval", "--model", "hf", "--model_args", "pretrained=smollm3,dtype=float32"],
         "--model_args pretrained=smollm3: no such directory, embedded name or hub id; did you mean smollm2?"),
        (["model-path", "smollm3"], "'smollm3' is not an embedded model; did you mean smollm2?"),
    ]  # fmt: skip
    for argv, message in cases:
        assert run(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and message in err, (argv, err)
    assert not out.exists()  # nothing written where the corrected rerun goes


def test_train_example_writes_the_shipped_config(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from moba_hf.train import EXAMPLE_CONFIG, TrainConfig

    clone = Path(__file__).resolve().parents[1] / "configs" / "train_cpu_demo.toml"
    assert EXAMPLE_CONFIG.read_text() == clone.read_text()  # one example: the clone's file is the wheel's
    monkeypatch.chdir(tmp_path)
    assert run(["train", "--example"]) == 0
    assert "moba-hf train train_cpu_demo.toml" in capsys.readouterr().out
    assert TrainConfig.from_file(tmp_path / "train_cpu_demo.toml") == TrainConfig.from_file(clone)
    assert run(["train", "--example"]) == 2  # an existing file is left alone
    assert "exists" in capsys.readouterr().err
    assert run(["train"]) == 2
    assert "moba-hf train --example" in capsys.readouterr().err
    assert "--example" in cli.build_parser(["train"])._subparsers._group_actions[0].choices["train"].format_help()


def test_offline_hub_id_is_taken_when_cached(tmp_path):
    """HF_HUB_OFFLINE=1: an org/name in the hub cache is accepted (from_pretrained reads it there), another refused."""
    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--cached" / "refs" / "main").write_text("abc123")
    code = (
        "from moba_hf.cli_args import UsageError, check_model\ncheck_model('org/cached')\n"
        "try:\n    check_model('org/missing')\nexcept UsageError as e:\n    print(e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("--model org/missing: no such directory, and HF_HUB_OFFLINE is set"), res.stdout
