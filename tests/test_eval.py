"""The evaluation suite on a tiny random Llama with the embedded model's tokenizer (offline, a few seconds)."""

import argparse
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from test_eval_resume import measured
from transformers import LlamaForCausalLM

from moba_hf import cli
from moba_hf.config import MobaConfig
from moba_hf.eval import cli as eval_cli
from moba_hf.eval.decoding import greedy_decode
from moba_hf.eval.niah import Haystack
from moba_hf.eval.passkey import passkey_eval, run_trial
from moba_hf.eval.ppl import window_nll, windows
from moba_hf.eval.run_records import RUN_FILE, TRIALS_FILE, RunMismatch
from moba_hf.eval.run_store import ResultStore
from moba_hf.eval.scoring import first_integer, score_niah, score_passkey
from moba_hf.eval.settings import (
    Setting,
    load_settings_file,
    parse_setting,
    resolve_settings,
    setting_args,
    use_setting,
)
from moba_hf.eval.texts import generated_text, load_texts
from moba_hf.prompts import build_prompt, passkey_line

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return LlamaForCausalLM.from_pretrained(tiny_dir, attn_implementation="sdpa").eval()


def run_cli(*argv: str) -> int:
    return cli.main(list(argv))


def read_trials(out) -> list[dict]:
    return [json.loads(line) for line in (out / TRIALS_FILE).read_text().splitlines()]


# --- scoring ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [(" 12345. Remember it.", 12345), ("The key is 7 or 8", 7), ("no digits here", None), ("x0042y", 42), ("", None)],
)
def test_first_integer(text, expected):
    assert first_integer(text) == expected


def test_passkey_score_is_exact_match_of_first_integer():
    assert score_passkey(12345, " 12345. Remember") == (12345, True)
    assert score_passkey(12345, " 1234 5") == (1234, False)
    assert score_passkey(12345, " 123456") == (123456, False)
    assert score_passkey(12345, " the pass key") == (None, False)
    assert score_passkey(12345, " 54321 is not it, 12345 is") == (54321, False)


def test_niah_score_numbers_and_text():
    assert score_niah("1234567", " 1234567.")
    assert not score_niah("1234567", " 123456 7")
    assert not score_niah("1234567", " 7654321, then 1234567")
    assert score_niah("eat a sandwich", " to Eat  a sandwich, in Dolores Park")
    assert not score_niah("eat a sandwich", " eat a salad")
    assert not score_niah("", " anything")


# --- prompts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [64, 301, 1024])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_prompt_length_and_depth(tokenizer, length, depth):
    prompt = build_prompt(tokenizer, length, depth, 31415)
    n = len(tokenizer(prompt, add_special_tokens=False).input_ids)
    assert length - 40 <= n <= length
    where = prompt.index(passkey_line(31415)) / len(prompt)
    assert abs(where - depth) < 0.2 if length > 64 else passkey_line(31415) in prompt


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_niah_prompt_length_and_depth(tokenizer, depth):
    hay = Haystack(tokenizer, [generated_text(3000)])
    prompt = hay.prompt(700, depth, "The code is 1234567.", "What is the code? The code is")
    assert len(tokenizer(prompt, add_special_tokens=False).input_ids) <= 700
    assert len(tokenizer(prompt, add_special_tokens=False).input_ids) >= 640
    body = prompt.rsplit("\n\n", 1)[0]
    assert abs(body.index("The code is 1234567.") / len(body) - depth) < 0.05
    assert prompt.endswith("What is the code? The code is")


def test_niah_haystack_repeats_short_text(tokenizer):
    hay = Haystack(tokenizer, ["One short sentence. Another one."])
    prompt = hay.prompt(200, 0.5, "The code is 1.", "Code?")
    assert 150 <= len(tokenizer(prompt, add_special_tokens=False).input_ids) <= 200


def test_bad_inputs_name_the_parameter(tokenizer):
    with pytest.raises(ValueError, match="depth"):
        build_prompt(tokenizer, 100, 1.5, 1)
    with pytest.raises(ValueError, match="lengths"):
        passkey_eval(None, tokenizer, ["sdpa"], lengths=[], out_dir="unused")
    with pytest.raises(ValueError, match="trials"):
        passkey_eval(None, tokenizer, ["sdpa"], lengths=[64], trials=0, out_dir="unused")
    with pytest.raises(ValueError, match="stride"):
        windows(100, 10, "sliding", stride=10)


# --- settings ---------------------------------------------------------------------------------------


def test_parse_settings(tmp_path):
    assert parse_setting("sdpa") == Setting("sdpa", "sdpa", None)
    assert parse_setting("moba") == Setting("moba", "moba", None)
    inline = parse_setting("moba:block_size=64,top_k=16,full_attn_layer_ids=[0,-1],pooling=max")
    assert inline.moba == MobaConfig(block_size=64, top_k=16, full_attn_layer_ids=(0, -1), pooling="max")
    assert inline.name == "moba(block_size=64,top_k=16,full_attn_layer_ids=[0,-1],pooling=max)"
    assert parse_setting("fine=moba:block_size=32,top_k=4").name == "fine"
    assert parse_setting(("dense", None)) == Setting("dense", "sdpa", None)
    assert parse_setting(("m", MobaConfig(top_k=2))).moba == MobaConfig(top_k=2)
    cfg = tmp_path / "mine.toml"
    cfg.write_text("[moba]\nblock_size = 128\ntop_k = 5\n")
    assert parse_setting(f"moba:{cfg}") == Setting("mine", "moba", MobaConfig(block_size=128, top_k=5))
    listing = tmp_path / "settings.toml"
    listing.write_text(
        '[[setting]]\nattn = "sdpa"\n\n[[setting]]\nname = "b64"\nmoba = { block_size = 64, top_k = 16 }\n\n'
        '[[setting]]\nmoba = "mine.toml"\n'
    )
    assert load_settings_file(listing) == [
        Setting("sdpa"), Setting("b64", "moba", MobaConfig(block_size=64, top_k=16)), parse_setting(f"moba:{cfg}")
    ]  # fmt: skip
    assert [x.name for x in setting_args(["full=sdpa", str(listing)])] == ["full", "sdpa", "b64", "mine"]
    assert [x.name for x in setting_args(None, [str(listing)])] == ["sdpa", "b64", "mine"]
    assert setting_args(None) == [Setting("sdpa")]
    with pytest.raises(ValueError, match="top_k"):
        parse_setting("moba:top_k=0")
    with pytest.raises(ValueError, match="unknown MoBA config keys"):
        parse_setting("moba:blocksize=64")
    with pytest.raises(ValueError, match="unique"):
        resolve_settings(["sdpa", "sdpa"])
    with pytest.raises(ValueError, match="neither a preset"):
        parse_setting("moba:missing.toml")
    assert parse_setting("moba:training-free") == Setting("training-free", "moba", MobaConfig.preset("training-free"))
    assert parse_setting("b64-k12-f3") == Setting("b64-k12-f3", "moba", MobaConfig(block_size=64, top_k=12,
                                                                                   full_attn_layers=3))  # fmt: skip


def test_use_setting_switches_and_restores(tiny):
    assert tiny.config._attn_implementation == "sdpa"
    with use_setting(tiny, parse_setting("moba:block_size=16,top_k=2")):
        assert tiny.config._attn_implementation == "moba"
        assert tiny.config.moba_config["block_size"] == 16
    assert tiny.config._attn_implementation == "sdpa" and getattr(tiny.config, "moba_config", None) is None
    with pytest.raises(RuntimeError, match="boom"), use_setting(tiny, Setting("eager", "eager")):
        assert tiny.config._attn_implementation == "eager"
        raise RuntimeError("boom")
    assert tiny.config._attn_implementation == "sdpa"


# --- decoding and perplexity against transformers -----------------------------------------------------


@pytest.mark.parametrize("setting", ["sdpa", "moba:block_size=16,top_k=2"])
def test_greedy_decode_matches_generate(tiny, tokenizer, setting):
    ids = tokenizer(build_prompt(tokenizer, 150, 0.5, 4242), return_tensors="pt").input_ids
    with use_setting(tiny, parse_setting(setting)):
        expected = tiny.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, ids.shape[1] :]
        decoded = greedy_decode(tiny, ids, 6)
    assert decoded.tokens == expected.tolist()
    assert decoded.prefill_seconds > 0
    if setting == "sdpa":
        assert decoded.sparsity == 0.0
    else:
        # top_k=2: own block + one earlier block for every query, exactly the block layout's count
        assert decoded.sparsity == pytest.approx(MobaConfig(block_size=16, top_k=2).theoretical_sparsity(ids.shape[1]))
        assert set(decoded.sparsity_per_layer) == {0, 1}


def test_run_trial_keeps_its_signature(tiny, tokenizer):
    trial = run_trial(tiny, tokenizer, 100, 0.5, 55555, max_new_tokens=4)
    assert (trial.length, trial.depth, trial.expected) == (100, 0.5, 55555)
    assert trial.prompt_tokens <= 101 and trial.prefill_seconds > 0 and trial.correct == (trial.got == 55555)


def test_window_nll_matches_model_loss(tiny):
    ids = torch.randint(0, 1000, (1, 97))
    with torch.no_grad():
        loss = tiny(input_ids=ids, labels=ids).loss
    out = window_nll(tiny, ids, 1)
    assert out["tokens_scored"] == 96
    assert out["nll_sum"] / 96 == pytest.approx(float(loss), rel=1e-5)
    with torch.no_grad():
        logits = tiny(input_ids=ids).logits[0]
    tail = torch.nn.functional.cross_entropy(logits[39:-1], ids[0, 40:], reduction="sum")
    assert window_nll(tiny, ids, 40)["nll_sum"] == pytest.approx(float(tail), rel=1e-5)


@pytest.mark.parametrize(
    "n, length, stride", [(100, 30, None), (100, 30, 7), (31, 30, 29), (64, 64, None), (7, 30, 3), (2, 2, 1)]
)
def test_sliding_windows_score_each_token_once(n, length, stride):
    scored = []
    for begin, end, score_from in windows(n, length, "sliding", stride):
        assert end - begin <= length and begin < score_from <= end
        scored += range(score_from, end)
    assert scored == list(range(1, n))
    assert windows(n, length, "first") == ([(0, length, 1)] if n >= length else [])


# --- the commands end to end --------------------------------------------------------------------------


def test_passkey_command_end_to_end_resume_and_failure(tiny_dir, tmp_path, capsys):
    out = tmp_path / "pk"
    argv = ["eval", "passkey", "--model", str(tiny_dir), "--lengths", "64,128", "--depths", "0,1", "--trials", "2",
            "--attn", "sdpa", "--attn", "moba:block_size=16,top_k=2", "--attn", "bad=moba:full_attn_layer_ids=[7]",
            "--out", str(out), "--no-progress"]  # fmt: skip
    assert run_cli(*argv) == 0
    results = json.loads((out / "results.json").read_text())
    trials = results["trials"]
    assert len(trials) == 2 * 2 * 2 * 2  # settings that ran x lengths x depths x trials
    first = trials[0]
    for field in ("setting", "length", "depth", "trial", "expected", "got", "correct", "prompt_tokens",
                  "prefill_seconds", "decode_seconds", "sparsity", "output"):  # fmt: skip
        assert field in first
    assert results["model"]["name"] == str(tiny_dir) and results["versions"]["torch"] == torch.__version__
    assert results["settings"]["moba(block_size=16,top_k=2)"]["moba"]["block_size"] == 16
    assert "bad" in results["failures"] and "full_attn_layer_ids" in results["failures"]["bad"]
    # same passkeys for every setting: a paired comparison
    by_cell = {}
    for t in trials:
        by_cell.setdefault((t["length"], t["depth"], t["trial"]), set()).add(t["expected"])
    assert all(len(v) == 1 for v in by_cell.values())
    assert {t["sparsity"] > 0.3 for t in trials if t["setting"] != "sdpa"} == {True}
    summary = (out / "summary.md").read_text()
    assert "| `sdpa` |" in summary and "`bad` (failed)" in summary and "accuracy @128" in summary
    assert (out / "passkey_heatmap.png").stat().st_size > 1000

    # resume: nothing left to do for the settings that finished; a new setting runs alone
    lines = len(read_trials(out))
    assert run_cli(*argv) == 0
    assert len(read_trials(out)) == lines
    assert run_cli(*argv, "--attn", "k1=moba:block_size=16,top_k=1") == 0
    new = read_trials(out)[lines:]
    assert len(new) == 8 and {t["setting"] for t in new} == {"k1"}
    # changing the task parameters in the same directory is refused, naming the parameter and both values
    assert run_cli(*[a if a != "2" else "3" for a in argv]) == 2
    assert "trials=2, this run has trials=3" in capsys.readouterr().err


def test_all_settings_failing_is_reported_not_raised(tiny_dir, tmp_path):
    # a known name that fails once the model has it: a dense layer past the tiny model's two layers
    code = run_cli("eval", "passkey", "--model", str(tiny_dir), "--lengths", "64", "--depths", "0.5", "--trials", "1",
                   "--attn", "bad=moba:full_attn_layer_ids=[7]", "--out", str(tmp_path / "f"),
                   "--no-progress")  # fmt: skip
    assert code == 1
    results = json.loads((tmp_path / "f" / "results.json").read_text())
    assert results["trials"] == [] and "bad" in results["failures"]


def test_niah_command_with_haystack_directory(tiny_dir, tmp_path):
    hay = tmp_path / "hay"
    hay.mkdir()
    (hay / "a.txt").write_text(generated_text(400, seed=1))
    (hay / "b.md").write_text(generated_text(400, seed=2))
    out = tmp_path / "niah"
    assert run_cli("eval", "niah", "--model", str(tiny_dir), "--lengths", "96,160", "--depths", "0,0.5,1",
                   "--trials", "1", "--attn", "sdpa", "--attn", "moba:block_size=32,top_k=2",
                   "--text", str(hay), "--out", str(out), "--no-progress") == 0  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert len(results["trials"]) == 2 * 2 * 3
    assert all(len(t["expected"]) == 7 and t["prompt_tokens"] <= t["length"] + 1 for t in results["trials"])
    assert (out / "niah_heatmap.png").stat().st_size > 1000
    assert "needle in a haystack" in (out / "summary.md").read_text()


@pytest.mark.parametrize("mode", ["first", "sliding"])
def test_ppl_command(tiny_dir, tmp_path, mode):
    text = tmp_path / "doc.txt"
    text.write_text(generated_text(600, seed=3))
    out = tmp_path / mode
    assert run_cli("eval", "ppl", "--model", str(tiny_dir), "--lengths", "64,128", "--text", str(text),
                   "--mode", mode, "--attn", "sdpa", "--attn", "moba:block_size=16,top_k=2", "--max-tokens", "200",
                   "--out", str(out), "--no-progress") == 0  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    records = results["trials"]
    scored = {(r["setting"], r["length"]): 0 for r in records}
    for r in records:
        scored[(r["setting"], r["length"])] += r["tokens_scored"]
    expected = {64: 199, 128: 199} if mode == "sliding" else {64: 63, 128: 127}
    assert {k: v for k, v in scored.items()} == {(s, n): expected[n] for s, n in scored}
    summary = (out / "summary.md").read_text()
    assert "ppl @128" in summary and "| `sdpa` |" in summary
    assert (out / "ppl.png").stat().st_size > 1000
    # a random model: perplexity near the vocabulary size, and the same for both settings where MoBA is exact
    sdpa = [r for r in records if r["setting"] == "sdpa" and r["length"] == 64]
    assert all(r["nll_sum"] > 0 for r in sdpa)


def test_result_store_refuses_a_changed_setting(tmp_path):
    with ResultStore(tmp_path, "passkey", {"a": 1}, {"name": "m"}) as store:
        store.add_setting(parse_setting("x=moba:top_k=2"))
        measured(store)
        store.write([], "")
    again = ResultStore(tmp_path, "passkey", {"a": 1}, {"name": "m"})
    again.add_setting(parse_setting("x=moba:top_k=2"))
    with pytest.raises(RunMismatch, match="has moba.top_k=2, this run defines it with moba.top_k=3"):
        again.add_setting(parse_setting("x=moba:top_k=3"))


def test_result_store_reads_a_setting_written_before_a_field_existed(tmp_path):
    with ResultStore(tmp_path, "passkey", {"a": 1}, {"name": "m"}) as store:
        store.add_setting(parse_setting("x=moba:top_k=2,dense_tail=0"))
        measured(store)
        store.write([], "")
    run = json.loads((tmp_path / RUN_FILE).read_text())
    del run["settings"]["x"]["moba"]["dense_tail"]  # as an older version wrote it
    (tmp_path / RUN_FILE).write_text(json.dumps(run))
    again = ResultStore(tmp_path, "passkey", {"a": 1}, {"name": "m"})
    again.add_setting(parse_setting("x=moba:top_k=2"))  # the default of the missing field: the same setting
    with pytest.raises(RunMismatch, match="has moba.dense_tail=0, this run defines it with moba.dense_tail=8"):
        again.add_setting(parse_setting("x=moba:top_k=2,dense_tail=8"))


def _interrupt_after(monkeypatch, n: int) -> None:
    """Ctrl-C in the middle of a run: the (n + 1)-th decode raises KeyboardInterrupt."""
    import moba_hf.eval.passkey as passkey

    calls = []

    def decode(*args, **kwargs):
        calls.append(1)
        if len(calls) > n:
            raise KeyboardInterrupt
        return greedy_decode(*args, **kwargs)

    monkeypatch.setattr(passkey, "greedy_decode", decode)


def test_resume_after_an_interrupt_refuses_another_experiment(tiny, tokenizer, tmp_path, monkeypatch):
    grid = {"lengths": [64], "depths": [0.0, 1.0], "trials": 2, "out_dir": tmp_path, "progress": False}
    _interrupt_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        passkey_eval(tiny, tokenizer, ["x=moba:block_size=16,top_k=2"], seed=1, max_new_tokens=2, **grid)
    monkeypatch.undo()
    assert len(read_trials(tmp_path)) == 3 and (tmp_path / RUN_FILE).is_file()
    assert not (tmp_path / "results.json").exists()
    # the parameters were recorded before the first trial: another seed is refused with both values
    with pytest.raises(RunMismatch, match="seed=1, this run has seed=2: .* new --out"):
        passkey_eval(tiny, tokenizer, ["x=moba:block_size=16,top_k=2"], seed=2, max_new_tokens=2, **grid)
    # so is a setting name redefined, before any trial runs
    with pytest.raises(RunMismatch, match="'x' .* has moba.block_size=16, this run defines it with moba.block_size=32"):
        passkey_eval(tiny, tokenizer, ["x=moba:block_size=32,top_k=2"], seed=1, max_new_tokens=2, **grid)
    assert len(read_trials(tmp_path)) == 3
    result = passkey_eval(tiny, tokenizer, ["x=moba:block_size=16,top_k=2"], seed=1, max_new_tokens=2, **grid)
    assert len(result.records) == 4 and len(read_trials(tmp_path)) == 4


def test_run_json_records_what_plain_moba_ran(tiny, tokenizer, tmp_path):
    grid = {"lengths": [64], "depths": [0.5], "trials": 1, "out_dir": tmp_path, "progress": False}
    passkey_eval(tiny, tokenizer, ["moba"], max_new_tokens=1, **grid)
    run = json.loads((tmp_path / RUN_FILE).read_text())
    assert run["settings"]["moba"]["moba"] == MobaConfig().to_dict()  # the defaults, spelled out
    assert run["params"]["seed"] == 0 and run["task"] == "passkey" and run["model"]["layers"] == 2


def test_a_torn_last_line_is_dropped_and_its_trial_rerun(tiny, tokenizer, tmp_path, caplog):
    grid = {"lengths": [64], "depths": [0.5], "trials": 3, "out_dir": tmp_path, "progress": False}
    passkey_eval(tiny, tokenizer, ["sdpa"], max_new_tokens=2, **grid)
    trials = tmp_path / TRIALS_FILE
    whole = trials.read_bytes()
    trials.write_bytes(whole[: len(whole) - 25])  # killed in the middle of writing the last line
    result = passkey_eval(tiny, tokenizer, ["sdpa"], max_new_tokens=2, **grid)
    assert "dropped the incomplete last line" in caplog.text
    assert len(result.records) == 3
    assert [t["trial"] for t in read_trials(tmp_path)] == [0, 1, 2]
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]  # every file was replaced whole


def test_a_corrupt_middle_line_is_refused_with_its_line_number(tmp_path):
    (tmp_path / RUN_FILE).write_text(json.dumps({"task": "passkey", "model": {}, "params": {}, "settings": {}}))
    (tmp_path / TRIALS_FILE).write_text('{"key": "a", "setting": "s"}\nnot json\n{"key": "b", "setting": "s"}\n')
    with pytest.raises(ValueError, match="line 2 is not a trial record"):
        ResultStore(tmp_path, "passkey", {}, {})


def test_load_texts_sources(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "skip.bin").write_text("binary")
    assert load_texts(tmp_path) == ["first", "second"]
    assert load_texts(tmp_path / "a.txt") == ["first"]
    assert len(load_texts(None, default_words=50)[0].split()) >= 50
    with pytest.raises(FileNotFoundError):
        load_texts(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="not both"):
        load_texts(tmp_path, dataset="x")


def test_lengths_parsing():
    assert eval_cli.parse_lengths("1K,2k,4096") == [1024, 2048, 4096]
    with pytest.raises(argparse.ArgumentTypeError, match="lengths"):
        eval_cli.parse_lengths("big")


def test_eval_and_lm_eval_are_moba_hf_subcommands():
    """`moba-hf --help` lists both, and `moba-hf eval --help` every task, in a fresh interpreter as a user runs it."""

    def help_text(*argv: str) -> str:
        code = f"from moba_hf import cli; cli.main({list(argv)!r})"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    commands = help_text("--help")
    assert re.search(r"^\s+eval\s+long-context evaluation", commands, re.M)
    assert re.search(r"^\s+lm-eval\s+lm-eval's command line", commands, re.M)
    tasks = re.findall(r"^ {4}([\w-]+)", help_text("eval", "--help"), re.M)
    assert tasks == ["passkey", "niah", "ppl", "sweep", "lm-eval-data"]
    args = cli.build_parser(["eval", "passkey"]).parse_args(["eval", "passkey", "--allow-changed"])
    assert args.func is eval_cli._run_passkey and args.allow_changed


@pytest.mark.slow
def test_passkey_smollm2_2k_sdpa(tmp_path):
    from moba_hf.models import load

    model, tok = load("smollm2")
    result = passkey_eval(model, tok, ["sdpa"], lengths=[2048], depths=[0.0, 0.25, 0.5, 0.75, 1.0], trials=1,
                          out_dir=tmp_path, progress=False, track=False)  # fmt: skip
    assert result.cells()[("sdpa", 2048)]["accuracy"] >= 0.8, result.summary


def test_inline_settings_are_named_whole_with_dotted_values():
    # a value with a dot (top_p=0.5) is not a file suffix: the name keeps every field
    first = parse_setting("moba:top_p=0.5,block_size=16,top_k=4")
    assert first.name == "moba(top_p=0.5,block_size=16,top_k=4)" and first.moba.top_p == 0.5
    both = resolve_settings(["moba:top_p=0.5,block_size=16,top_k=4", "moba:top_p=0.8,block_size=16,top_k=4"])
    assert [s.name for s in both] == ["moba(top_p=0.5,block_size=16,top_k=4)", "moba(top_p=0.8,block_size=16,top_k=4)"]


def test_mistyped_attention_names_are_refused_with_the_closest(tmp_path):
    with pytest.raises(ValueError, match="unknown attention 'sdpaa'; did you mean 'sdpa'"):
        parse_setting("sdpaa")
    with pytest.raises(ValueError, match="did you mean 'b64-k12-f3'"):
        parse_setting("b64-k12-f4")
    with pytest.raises(ValueError, match="did you mean 'moba'"):
        parse_setting("mobaa:top_k=3")
    with pytest.raises(ValueError, match="did you mean 'training-free'"):
        parse_setting("moba:trainingfree")
    listing = tmp_path / "settings.toml"
    listing.write_text('[[setting]]\nattn = "eagre"\n')
    with pytest.raises(ValueError, match="did you mean 'eager'"):
        load_settings_file(listing)
    # what transformers takes besides its registry: eager, a paged| prefix, a hub kernel
    for name in ("eager", "flex_attention", "paged|eager", "kernels-community/flash-attn"):
        assert parse_setting(name).attn == name


def test_summary_speed_up_is_higher_when_faster():
    from moba_hf.eval.report import summary_table

    records = [
        {"setting": "sdpa", "length": 64, "correct": True, "prefill_seconds": 2.0, "sparsity": 0.0},
        {"setting": "moba", "length": 64, "correct": True, "prefill_seconds": 1.0, "sparsity": 0.5},
    ]
    table = summary_table(records, ["sdpa", "moba"], [64], metric="accuracy")
    assert "| speed-up vs sdpa (>1 = faster) |" in table
    assert "| `moba` | 1.00 (1/1) | 1.00 | 1.000 | 2.00x | 0.500 |" in table
