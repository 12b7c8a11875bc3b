"""benchmarks/serve_passkey.py without vLLM or a model: option checks, the server command, the resume rule."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("serve_passkey", ROOT / "benchmarks" / "serve_passkey.py")
serve_passkey = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = serve_passkey  # dataclasses look their module up while the file runs
spec.loader.exec_module(serve_passkey)

DCA_MOBA = '{"block_size": 512, "top_k": 3, "decode": "full", "dca": {"pretraining_length": 4096, "temperature": true}}'


def window_8k() -> LlamaConfig:
    return LlamaConfig(max_position_embeddings=8192, num_hidden_layers=2, hidden_size=64, num_attention_heads=4)


def plan(**changes):
    options = dict(moba=serve_passkey.DEFAULT_MOBA, lengths=[16384], trials=None, depths=None, max_tokens=8,
                   hf_config=window_8k(), shortest=64)  # fmt: skip
    return serve_passkey.make_plan(**{**options, **changes})


def test_default_plan_is_dense_dca_at_16k_with_the_rope_table_raised():
    hf_config = window_8k()
    p = plan(hf_config=hf_config)
    assert p.max_model_len == 16392
    assert p.overrides["max_position_embeddings"] == 16392
    assert p.overrides["moba_config"]["sparse"] is False
    assert p.overrides["moba_config"]["dca"]["pretraining_length"] == 4096
    assert p.dca_text == "c=4096 s=3584 temperature=on"
    assert [(n, d, i) for n, d, i in p.cells] == [(16384, 0.1, 0), (16384, 0.3, 1), (16384, 0.5, 2),
                                                  (16384, 0.7, 3), (16384, 0.9, 4)]  # fmt: skip
    assert hf_config.max_position_embeddings == 8192  # the caller's config is not changed
    # with MoBA the chunk is rounded down to a multiple of the block
    assert plan(moba=DCA_MOBA, trials=3).dca_text == "c=4096 s=3584 temperature=on"


def test_inside_the_window_nothing_is_raised():
    p = plan(moba='{"block_size": 512, "top_k": 3}', lengths=[4096, 2048], depths=[0.5])
    assert p.max_model_len == 4104 and "max_position_embeddings" not in p.overrides and p.dca is None
    assert p.cells == ((2048, 0.5, 0), (4096, 0.5, 0))
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" not in serve_passkey.serve_env(p, 2)
    assert serve_passkey.serve_env(plan(), 2)["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] == "1"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"moba": '{"block_size": 512}'}, "--lengths 16384 + --max-tokens 8 go past the model's window of 8192"),
        ({"moba": '{"sparse": false, "dca": {}}'}, "--moba dca needs pretraining_length past the model's window"),
        ({"moba": '{"sparse": false, "dca": {"pretraining_length": 16384}}'}, "pretraining_length=16384 is past"),
        ({"moba": '{"block_size": 500, "dca": {"pretraining_length": 4096, "chunk_size": 3584}}'},
         "chunk_size=3584 must be a multiple of the MoBA block_size=500"),
        ({"moba": '{"top_k": 0}'}, "--moba '{\"top_k\": 0}': top_k must be an integer >= 1"),
        ({"moba": "no-such-preset"}, "--moba 'no-such-preset': MoBA config 'no-such-preset' is neither a preset"),
        ({"lengths": [32]}, "--lengths must be >= 64 tokens"),
        ({"trials": 0}, "--trials must be an integer >= 1"),
        ({"trials": 3, "depths": [0.5]}, "--trials 3 and --depths (1 values: one trial each) disagree"),
        ({"depths": [1.5]}, "--depths must be fractions in [0, 1]"),
        ({"max_tokens": 0}, "--max-tokens must be an integer >= 1"),
    ],
    ids=["no-dca", "dca-without-c", "c-past-window", "chunk-not-block-multiple", "bad-moba", "unknown-preset",
         "too-short", "no-trials", "trials-vs-depths", "depth-range", "no-answer-tokens"],
)  # fmt: skip
def test_bad_options_are_refused_by_name(changes, message):
    with pytest.raises(ValueError) as error:
        plan(**changes)
    assert message in str(error.value)


def test_server_command_carries_the_plan():
    p = plan()
    command = serve_passkey.serve_command("/m", 8123, p, dtype="float32", max_num_batched_tokens=None)
    assert command[3:5] == ["serve", "/m"]
    assert command[command.index("--max-model-len") + 1] == "16392"
    assert command[command.index("--port") + 1] == "8123" and "--enforce-eager" in command
    assert json.loads(command[command.index("--hf-overrides") + 1]) == p.overrides
    assert "--max-num-batched-tokens" not in command
    chunked = serve_passkey.serve_command("/m", 8123, p, dtype="float32", max_num_batched_tokens=4096)
    assert chunked[-2:] == ["--max-num-batched-tokens", "4096"]


def row(plan, length, depth, trial, correct=True, **changes):
    fixed = {field: "" for field in serve_passkey.FIELDS}
    fields = {"model": "m", "dtype": "float32", "moba": plan.moba_json, "seed": 0, "max_tokens": 8, "length": length,
              "depth": depth, "trial": trial, "passkey": 12345, "answer": " 12345.", "correct": correct}  # fmt: skip
    return {**fixed, **fields, **changes}


def test_rerun_skips_the_trials_of_the_same_config_only(tmp_path):
    out = tmp_path / "rows.csv"
    dense, sparse = plan(), plan(moba=DCA_MOBA)
    serve_passkey.append_row(out, row(dense, 16384, 0.1, 0))
    serve_passkey.append_row(out, row(dense, 16384, 0.3, 1, correct=False))
    serve_passkey.append_row(out, row(sparse, 16384, 0.5, 2))
    serve_passkey.append_row(out, row(dense, 16384, 0.5, 2, seed=1))  # another seed: another experiment
    config = ("m", "float32", dense.moba_json, "0", "8")
    done = serve_passkey.read_rows(out, config)
    assert sorted(done) == [(16384, 0.1, 0), (16384, 0.3, 1)]
    assert done[(16384, 0.3, 1)]["correct"] == "False"
    todo = [cell for cell in dense.cells if cell not in done]
    assert todo == [(16384, 0.5, 2), (16384, 0.7, 3), (16384, 0.9, 4)]
    assert sorted(serve_passkey.read_rows(out, ("m", "float32", sparse.moba_json, "0", "8"))) == [(16384, 0.5, 2)]
    assert serve_passkey.read_rows(tmp_path / "missing.csv", config) == {}


def test_a_file_with_other_columns_is_refused(tmp_path):
    out = tmp_path / "other.csv"
    out.write_text("tokens,ttft\n16384,1.0\n")
    with pytest.raises(ValueError, match="--csv .*other.csv has columns"):
        serve_passkey.read_rows(out, ("m", "float32", "{}", "0", "8"))


def test_dry_run_lists_only_the_trials_not_in_the_file(tmp_path, capsys):
    out = tmp_path / "rows.csv"
    dense = plan()
    serve_passkey.append_row(out, row(dense, 16384, 0.1, 0, model="smollm2-135m-instruct"))
    serve_passkey.append_row(out, row(dense, 16384, 0.9, 4, model="smollm2-135m-instruct"))
    assert serve_passkey.main(["--csv", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "5 trials, 2 already in" in printed and "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in printed
    assert (
        "to run: length 16384 depth 0.3 trial 1, length 16384 depth 0.5 trial 2, length 16384 depth 0.7 trial 3\n"
        in printed
    )
