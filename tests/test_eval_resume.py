"""Resuming an evaluation run directory under hostile conditions: other weights under the same path, damaged
run.json / trials.jsonl, two runs into one directory at once, and lengths past the model's window."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from moba_hf import cli, rundir
from moba_hf.eval import fingerprint, run_store
from moba_hf.eval.fingerprint import file_digests, weights_fingerprint
from moba_hf.eval.grid import window_warnings
from moba_hf.eval.passkey import passkey_eval
from moba_hf.eval.run_records import RESULTS_FILE, RUN_FILE, TRIALS_FILE, CorruptRunFile, RunInUse, RunMismatch
from moba_hf.eval.run_store import ResultStore
from moba_hf.eval.settings import Setting, parse_setting
from moba_hf.window import PastWindow

pytestmark = pytest.mark.usefixtures("one_thread")


def save_tiny(path, tokenizer, seed: int, window: int = 1024):
    """A tiny random Llama checkpoint over the embedded tokenizer: the same shapes (and file size) for every seed."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "llama", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=window,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_llama_config(**config):
    return AutoConfig.for_model("llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, **config)  # fmt: skip


def read_trials(out) -> list[dict]:
    return [json.loads(line) for line in (out / TRIALS_FILE).read_text().splitlines()]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """File digests cached in the test's own directory."""
    monkeypatch.setenv("MOBA_HF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# --- another model under the same path --------------------------------------------------------------------


def test_overwritten_weights_are_refused_then_resumed_on_request(tmp_path, tokenizer, cache, capsys):
    ckpt = save_tiny(tmp_path / "ckpt", tokenizer, seed=0)
    out = tmp_path / "out"
    argv = ["eval", "passkey", "--model", str(ckpt), "--lengths", "64", "--depths", "0,1", "--trials", "2",
            "--max-new-tokens", "1", "--attn", "sdpa", "--out", str(out), "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    first = json.loads((out / RUN_FILE).read_text())["model"]["weights"]
    assert first.startswith("files:sha256:")
    size = (ckpt / "model.safetensors").stat().st_size
    save_tiny(ckpt, tokenizer, seed=1)  # other weights: the same file name, path and size
    assert (ckpt / "model.safetensors").stat().st_size == size
    lines = (out / TRIALS_FILE).read_text().splitlines(keepends=True)
    (out / TRIALS_FILE).write_text("".join(lines[:2]))  # half the trials gone: a resume would run the rest
    capsys.readouterr()

    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f'holds a run with model.weights="{first}", this run has model.weights="files:sha256:' in err
    assert "--allow-changed" in err and len(read_trials(out)) == 2  # nothing ran

    assert cli.main([*argv, "--allow-changed"]) == 0
    run = json.loads((out / RUN_FILE).read_text())
    (change,) = run["changes"]
    assert change["differences"]["model.weights"]["was"] == first
    assert change["differences"]["model.weights"]["now"] == run["model"]["weights"] != first
    assert change["trials_before"] == 2
    results = json.loads((out / RESULTS_FILE).read_text())
    assert results["changes"] == run["changes"] and len(results["trials"]) == 4
    assert "> warning:" in (out / "summary.md").read_text() and "resumed with --allow-changed" in results["warnings"][0]
    # run.json now pins the new weights: a plain resume goes on, and still says its trials are mixed
    assert cli.main(argv) == 0
    assert "differing in model.weights" in (out / "summary.md").read_text()


def test_weights_fingerprint_of_a_model_built_in_python_follows_every_tensor():
    model = LlamaForCausalLM(tiny_llama_config())
    first = weights_fingerprint(model)
    assert first.startswith("params:sha256:") and weights_fingerprint(model) == first
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[3, 5] += 1e-3  # one element of one tensor
    assert weights_fingerprint(model) != first
    assert weights_fingerprint(model.to(torch.bfloat16)) != weights_fingerprint(model.to(torch.float32))


def test_file_digests_see_an_overwrite_that_keeps_size_and_mtime(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(fingerprint, "CACHE_MIN_BYTES", 0)  # cache even this small file
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"a" * 1000)
    first = file_digests([path])[path]
    entry = json.loads((cache / fingerprint.DIGESTS_FILE).read_text())[str(path.resolve())]
    assert entry["sha256"] == first
    # a cached digest is reused while the file is unchanged (so a fake one in the cache comes back) ...
    entry["sha256"] = "cached"
    (cache / fingerprint.DIGESTS_FILE).write_text(json.dumps({str(path.resolve()): entry}))
    assert file_digests([path])[path] == "cached"
    # ... and an overwrite with the same size and the old mtime put back is still seen (ctime moves)
    stat = path.stat()
    path.write_bytes(b"b" * 1000)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert file_digests([path])[path] not in ("cached", first)


def measured(store, setting="x"):
    """One trial of `setting` in `store`: a run that measured something, so a rerun resumes it."""
    store.add({"key": f"{setting}|length=128", "setting": setting, "length": 128, "correct": True})


def test_every_differing_key_is_named(tmp_path):
    with ResultStore(tmp_path, "passkey", {"a": 1, "b": 2, "c": 3}, {"name": "m"}) as store:
        measured(store)
    expected = r'model.name="m", this run has model.name="other" \(also differing: a 1 -> 5, b 2 -> 6\): '
    with pytest.raises(RunMismatch, match=expected):
        ResultStore(tmp_path, "passkey", {"a": 5, "b": 6, "c": 3}, {"name": "other"})


def test_another_task_is_refused_even_on_request(tmp_path):
    with ResultStore(tmp_path, "niah", {}, {"name": "m"}) as store:
        measured(store)
    with pytest.raises(RunMismatch, match="holds a niah run, this is a passkey run: use a new --out"):
        ResultStore(tmp_path, "passkey", {}, {"name": "m"}, allow_changed=True)


def test_a_redefined_setting_is_allowed_on_request_and_recorded(tmp_path):
    with ResultStore(tmp_path, "passkey", {}, {"name": "m"}) as store:
        store.add_setting(parse_setting("x=moba:top_k=2"))
        measured(store)
    with ResultStore(tmp_path, "passkey", {}, {"name": "m"}) as store, pytest.raises(RunMismatch, match="top_k"):
        store.add_setting(parse_setting("x=moba:top_k=3"))
    with ResultStore(tmp_path, "passkey", {}, {"name": "m"}, allow_changed=True) as store:
        store.add_setting(parse_setting("x=moba:top_k=3"))
    run = json.loads((tmp_path / RUN_FILE).read_text())
    assert run["settings"]["x"]["moba"]["top_k"] == 3
    assert run["changes"][0]["differences"] == {"settings.x.moba.top_k": {"was": 2, "now": 3}}


def test_a_run_that_stopped_before_its_first_trial_blocks_no_rerun(tmp_path):
    """Nothing was measured: other parameters, another task or a redefined setting simply start the run anew."""
    with ResultStore(tmp_path, "passkey", {"a": 1}, {"name": "m"}) as store:
        store.add_setting(parse_setting("x=moba:top_k=2"))
    with ResultStore(tmp_path, "niah", {"a": 2}, {"name": "other"}) as store:
        store.add_setting(parse_setting("x=moba:top_k=3"))
        measured(store)
    run = json.loads((tmp_path / RUN_FILE).read_text())
    assert run["task"] == "niah" and run["params"] == {"a": 2} and run["settings"]["x"]["moba"]["top_k"] == 3
    assert "changes" not in run
    with ResultStore(tmp_path, "niah", {"a": 2}, {"name": "other"}) as store:  # a setting never measured
        store.add_setting(parse_setting("y=moba:top_k=2"))
    with ResultStore(tmp_path, "niah", {"a": 2}, {"name": "other"}) as store:
        store.add_setting(parse_setting("y=moba:top_k=4"))
        with pytest.raises(RunMismatch, match="top_k"):
            store.add_setting(parse_setting("x=moba:top_k=2"))


def test_a_setting_that_failed_before_its_first_trial_can_be_corrected_into_the_same_out(tiny_dir, tmp_path):
    """The command: a setting valid on paper that fails at run time leaves run.json, which the rerun replaces."""
    out = tmp_path / "run"
    base = ["eval", "passkey", "--model", str(tiny_dir), "--lengths", "128", "--trials", "1", "--device", "cpu"]
    assert cli.main([*base, "--attn", "x=moba:full_attn_layer_ids=[7]", "--out", str(out)]) == 1  # every setting failed
    assert not (out / TRIALS_FILE).exists() or not (out / TRIALS_FILE).read_text().strip()
    assert cli.main([*base, "--attn", "x=moba:block_size=32,top_k=2", "--out", str(out)]) == 0
    assert json.loads((out / RUN_FILE).read_text())["settings"]["x"]["moba"]["block_size"] == 32


# --- damaged run.json and trials.jsonl ----------------------------------------------------------------------

GOOD_RUN = {"task": "passkey", "model": {}, "params": {}, "settings": {}}


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"{not json", "is not valid JSON"),
        (b"\xff\xfe\x00binary", "is not valid JSON"),
        (b"[1, 2, 3]", "holds an array, not a run record"),
        (json.dumps({**GOOD_RUN, "model": []}).encode(), "'model' must be an object, got \\[\\]"),
        (json.dumps({"model": {}, "params": {}}).encode(), "'task' must be a string, got null"),
        (json.dumps({**GOOD_RUN, "settings": {"x": 3}}).encode(), "setting 'x' must be an object"),
        (json.dumps({**GOOD_RUN, "changes": [1]}).encode(), "'changes' must list objects"),
    ],
)
def test_a_damaged_run_json_is_refused_naming_the_file(tmp_path, content, problem):
    (tmp_path / RUN_FILE).write_bytes(content)
    with pytest.raises(CorruptRunFile, match=f"{tmp_path / RUN_FILE}:? .*{problem}"):
        ResultStore(tmp_path, "passkey", {}, {})


def test_a_damaged_run_json_through_the_command(tiny_dir, tmp_path, capsys):
    (tmp_path / RUN_FILE).write_text('{"task": "passkey", "model": ')
    code = cli.main(["eval", "passkey", "--model", str(tiny_dir), "--lengths", "64", "--out", str(tmp_path),
                     "--no-progress"])  # fmt: skip
    assert code == 2
    assert f"{tmp_path / RUN_FILE} is not valid JSON" in capsys.readouterr().err


RECORD = '{"key": "k%d", "setting": "s"}'


@pytest.mark.parametrize(
    "lines, problem",
    [
        ([RECORD % 1, "[1, 2, 3]", RECORD % 3], "line 2 is not a trial record \\(an array, not an object"),
        (['{"setting": "s"}', RECORD % 2], "line 1 is not a trial record \\(an object without a string 'key' field"),
        ([RECORD % 1, '{"key": 7}'], "line 2 .*without a string 'key' or 'setting' field"),
        ([RECORD % 1, '"text"'], "line 2 is not a trial record \\(a string, not an object"),
        ([RECORD % 1, "not json", RECORD % 3], "line 2 is not a trial record \\(not JSON"),
        ([RECORD % 1, '{"key": "k2", "sett'], "line 2 is not a trial record \\(not JSON"),  # ends with a newline
    ],
)
def test_a_line_that_is_not_a_trial_record_is_refused_with_file_and_line(tmp_path, lines, problem):
    (tmp_path / RUN_FILE).write_text(json.dumps(GOOD_RUN))
    (tmp_path / TRIALS_FILE).write_text("\n".join(lines) + "\n")
    with pytest.raises(CorruptRunFile, match=f"{tmp_path / TRIALS_FILE} {problem}"):
        ResultStore(tmp_path, "passkey", {}, {})


def test_only_an_unterminated_last_line_counts_as_an_interrupted_write(tmp_path, caplog):
    (tmp_path / RUN_FILE).write_text(json.dumps(GOOD_RUN))
    trials = tmp_path / TRIALS_FILE
    trials.write_text(f"{RECORD % 1}\n{RECORD % 2}\n[1, 2")  # a non-record cut short: not one of our writes
    with pytest.raises(CorruptRunFile, match="line 3"):
        ResultStore(tmp_path, "passkey", {}, {})
    trials.write_text(f"{RECORD % 1}\n{RECORD % 2}\n[1, 2, 3]")  # whole JSON, not a record, no newline
    with pytest.raises(CorruptRunFile, match="line 3 is not a trial record \\(an array"):
        ResultStore(tmp_path, "passkey", {}, {})
    trials.write_text(f"{RECORD % 1}\n{RECORD % 2}\n" + (RECORD % 3)[:-9])  # a record cut by a kill
    with caplog.at_level(logging.WARNING, "moba_hf"), ResultStore(tmp_path, "passkey", {}, {}) as store:
        assert sorted(store.trials) == ["k1", "k2"]
    assert f"dropped the incomplete last line of {trials} (line 3, an interrupted write)" in caplog.text
    assert trials.read_text() == f"{RECORD % 1}\n{RECORD % 2}\n"
    trials.write_bytes(trials.read_bytes() + b"\0" * 40)  # the zeros of a write the file system lost
    with ResultStore(tmp_path, "passkey", {}, {}) as store:
        assert sorted(store.trials) == ["k1", "k2"]
    assert trials.read_text() == f"{RECORD % 1}\n{RECORD % 2}\n"


def test_a_short_write_is_taken_back(tmp_path, monkeypatch):
    """A full disk writes part of a line: the part is removed, so the next record starts its own line."""
    store = ResultStore(tmp_path, "passkey", {}, {})
    store.add({"key": "k1", "setting": "s"})
    write = os.write

    def half(fd, data):
        return write(fd, data[: len(data) // 2]) if data.startswith(b'{"key": "k2"') else write(fd, data)

    monkeypatch.setattr(run_store.os, "write", half)
    with pytest.raises(OSError, match="wrote 15 of the 30 bytes of a trial record"):
        store.add({"key": "k2", "setting": "s"})
    monkeypatch.undo()
    store.add({"key": "k3", "setting": "s"})
    store.close()
    assert [t["key"] for t in read_trials(tmp_path)] == ["k1", "k3"]


# --- two runs into one directory ----------------------------------------------------------------------------


def test_a_second_store_on_an_open_directory_is_refused(tmp_path):
    with ResultStore(tmp_path, "passkey", {}, {}):
        assert (tmp_path / rundir.LOCK_FILE).read_text().startswith(f"{os.getpid()} on ")
        with pytest.raises(RunInUse, match=f"{tmp_path} is in use by another run \\(pid {os.getpid()} on "):
            ResultStore(tmp_path, "passkey", {}, {})
    assert not (tmp_path / rundir.LOCK_FILE).exists()  # removed when the run ends
    ResultStore(tmp_path, "passkey", {}, {}).close()  # free again once the first is closed


def test_a_run_in_another_process_holds_the_directory(tmp_path):
    holder = textwrap.dedent("""
        import sys
        from moba_hf.eval.run_store import ResultStore
        store = ResultStore(sys.argv[1], "passkey", {}, {"name": "m"})
        print("ready", flush=True)
        sys.stdin.read()
    """)
    child = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(RunInUse, match=f"pid {child.pid} on .*run.lock"):
            ResultStore(tmp_path, "passkey", {}, {"name": "m"})
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    ResultStore(tmp_path, "passkey", {}, {"name": "m"}).close()


def test_the_command_refuses_a_directory_in_use(tiny_dir, tmp_path, capsys):
    with ResultStore(tmp_path, "passkey", {}, {}):
        code = cli.main(["eval", "passkey", "--model", str(tiny_dir), "--lengths", "64", "--depths", "0.5",
                         "--trials", "1", "--out", str(tmp_path), "--no-progress"])  # fmt: skip
    assert code == 2
    assert f"{tmp_path} is in use by another run (pid {os.getpid()}" in capsys.readouterr().err
    assert not (tmp_path / TRIALS_FILE).exists()


# --- lengths past the model's window ------------------------------------------------------------------------


def test_lengths_past_the_window_are_warned_about_in_the_log_and_the_results(tmp_path, tokenizer, caplog):
    model = LlamaForCausalLM.from_pretrained(save_tiny(tmp_path / "ckpt", tokenizer, 0, window=128)).eval()
    grid = {"depths": [0.5], "trials": 1, "max_new_tokens": 2, "progress": False}
    with caplog.at_level(logging.WARNING, "moba_hf"):
        result = passkey_eval(model, tokenizer, ["sdpa"], lengths=[64], out_dir=tmp_path / "inside", **grid)
    assert "window" not in caplog.text and "warning" not in result.summary
    with caplog.at_level(logging.WARNING, "moba_hf"):
        result = passkey_eval(model, tokenizer, ["sdpa"], lengths=[64, 160], out_dir=tmp_path / "past", **grid)
    expected = "length 160 (+2 generated tokens) uses 162 positions, past the model's trained window of 128 positions"
    assert expected in caplog.text and "moba:dca-dense" in caplog.text
    assert "). Settings without DCA: sdpa" in caplog.text
    assert expected in (tmp_path / "past" / "summary.md").read_text() and expected in result.summary
    assert expected in json.loads((tmp_path / "past" / RESULTS_FILE).read_text())["warnings"][0]


def test_dca_settings_read_past_the_window_without_a_warning():
    model = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=128))
    dca = parse_setting("moba:dca-dense")
    (warning,) = window_warnings(model, [Setting("sdpa"), dca, parse_setting("moba:top_k=2")], [160], 2)
    assert warning.endswith(". Settings without DCA: sdpa, moba(top_k=2)")
    assert window_warnings(model, [dca], [160], 2) == []
    assert window_warnings(model, [Setting("sdpa")], [126], 2) == []


def test_lengths_past_a_learned_position_table_are_refused(tmp_path, capsys):
    model = GPT2LMHeadModel(GPT2Config(n_positions=64, n_layer=1, n_embd=16, n_head=2, vocab_size=100))
    with pytest.raises(PastWindow, match="length 100 \\(\\+8 generated tokens\\) needs 108 positions"):
        window_warnings(model, [Setting("sdpa")], [32, 100], 8)
    # the command refuses before loading anything: the directory holds only a config, not even a tokenizer
    ckpt = tmp_path / "gpt2"
    GPT2Config(n_positions=64, n_layer=1, n_embd=16, n_head=2, vocab_size=100).save_pretrained(ckpt)
    code = cli.main(["eval", "passkey", "--model", str(ckpt), "--lengths", "100", "--out", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--lengths 100 (+8 generated tokens) needs 108 positions, but this model has a learned table of 64 " in err
    assert "64 positions (n_positions) and no RoPE" in err
    assert not (tmp_path / "out").exists()


# --- records of another type --------------------------------------------------------------------------------


def test_a_hand_edited_trial_of_another_type_is_refused_by_the_command(tmp_path, tokenizer, cache, capsys):
    """'"correct": "false"' would count as correct (bool("false") is True): refused, naming file, line and field."""
    ckpt = save_tiny(tmp_path / "ckpt", tokenizer, seed=0)
    out = tmp_path / "out"
    argv = ["eval", "passkey", "--model", str(ckpt), "--lengths", "64", "--depths", "0,1", "--trials", "1",
            "--max-new-tokens", "1", "--attn", "sdpa", "--out", str(out), "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    trials = read_trials(out)
    assert [t["correct"] for t in trials] == [False, False]  # a random model
    trials[1]["correct"] = "false"
    (out / TRIALS_FILE).write_text("".join(json.dumps(t) + "\n" for t in trials))
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"{out / TRIALS_FILE} line 2 is not a trial record (field 'correct' is \"false\" (a string), " in err
    assert "expected a boolean" in err


@pytest.mark.parametrize(
    "record, problem",
    [
        ({"length": "128"}, "field 'length' is \"128\" \\(a string\\), expected an integer"),
        ({"correct": "false"}, "field 'correct' is \"false\" \\(a string\\), expected a boolean"),
        ({"correct": 0}, "field 'correct' is 0 \\(a number\\), expected a boolean"),
        ({"depth": True}, "field 'depth' is true \\(a boolean\\), expected a number"),
        ({"sparsity": "0.5"}, "field 'sparsity' is \"0.5\" \\(a string\\), expected a number or null"),
        ({"sparsity_per_layer": {"0": "x"}}, "field 'sparsity_per_layer' is \\{\"0\": \"x\"\\} \\(an object\\), "
                                             "expected an object of numbers"),
        ({"prefill_seconds": None}, "field 'prefill_seconds' is null \\(null\\), expected a number"),
        ({"length": 256}, "field 'length' is 256, its key says length=128"),  # moved to another column
    ],
)  # fmt: skip
def test_a_trial_field_of_another_type_is_refused_naming_line_field_value_and_type(tmp_path, record, problem):
    good = {"key": "s|depth=0.5|length=128|trial=0", "setting": "s", "depth": 0.5, "length": 128, "trial": 0,
            "correct": False, "sparsity": 0.5, "sparsity_per_layer": {"0": 0.5}, "prefill_seconds": 0.1}  # fmt: skip
    (tmp_path / RUN_FILE).write_text(json.dumps(GOOD_RUN))
    (tmp_path / TRIALS_FILE).write_text(json.dumps(good) + "\n" + json.dumps({**good, **record}) + "\n")
    with pytest.raises(CorruptRunFile, match=f"{tmp_path / TRIALS_FILE} line 2 is not a trial record \\({problem}"):
        ResultStore(tmp_path, "passkey", {}, {})
    (tmp_path / TRIALS_FILE).write_text(json.dumps(good) + "\n")
    with ResultStore(tmp_path, "passkey", {}, {}) as store:  # the record as written reads back
        assert store.trials == {good["key"]: good}


def test_a_stale_lock_of_a_killed_run_is_taken_over_with_a_log_line(tmp_path, caplog):
    holder = "import sys\nfrom moba_hf.eval.run_store import ResultStore\nResultStore(sys.argv[1], 'passkey', {}, {})\n"
    holder += "print('ready', flush=True)\nsys.stdin.read()\n"
    child = subprocess.Popen([sys.executable, "-c", holder, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "ready"
    finally:
        child.kill()  # kill -9: run.lock stays behind with its pid
        child.wait(timeout=60)
    assert (tmp_path / rundir.LOCK_FILE).read_text().startswith(f"{child.pid} on ")
    with caplog.at_level(logging.WARNING, "moba_hf"), ResultStore(tmp_path, "passkey", {}, {}):
        assert (tmp_path / rundir.LOCK_FILE).read_text().startswith(f"{os.getpid()} on ")
    assert f"took over the lock of pid {child.pid} on " in caplog.text
    assert "which ended without releasing it" in caplog.text
