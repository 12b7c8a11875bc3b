"""Our passkey / NIAH tasks through lm-evaluation-harness, with "moba" registered by `moba-hf lm-eval`."""

import importlib.util
import json

import pytest

from moba_hf.config import MobaConfig
from moba_hf.eval.harness import TASKS_DIR, _moba_from_args, _with_embedded_paths, run_lm_eval, write_task_data
from moba_hf.integration import track_sparsity

pytestmark = pytest.mark.usefixtures("one_thread")

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def task_dir(tiny_dir, tokenizer):
    """The tiny checkpoint with small passkey / NIAH task data next to it."""
    write_task_data(tokenizer, tiny_dir / "data", lengths=[64, 96], depths=[0.0, 1.0])
    return tiny_dir


def _load_utils():
    spec = importlib.util.spec_from_file_location("moba_lm_eval_utils", TASKS_DIR / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_task_data_loads():
    utils = _load_utils()
    for task in ("passkey", "niah"):
        data = getattr(utils, f"{task}_dataset")()["test"]
        assert len(data) == 15 and set(data.column_names) >= {"prompt", "answer", "length", "depth"}
        assert data[0]["prompt"] and data[0]["answer"].isdigit() and data[0]["answer"] in data[0]["prompt"]
        short = getattr(utils, f"{task}_dataset")(max_length=2048)["test"]
        assert sorted(set(short["length"])) == [1024, 2048]
    assert (TASKS_DIR / "moba_passkey.yaml").is_file() and (TASKS_DIR / "moba_niah.yaml").is_file()


def test_moba_model_args():
    assert _moba_from_args({"pretrained": "x"}) is None
    args = {"pretrained": "x", "moba_block_size": 64, "moba_top_k": 16}
    assert _moba_from_args(args) == MobaConfig(block_size=64, top_k=16) and args == {"pretrained": "x"}
    assert _moba_from_args({"moba": "block_size=32;top_k=4", "moba_pooling": "max"}) == MobaConfig(
        block_size=32, top_k=4, pooling="max"
    )


def test_embedded_model_name_becomes_its_local_directory(monkeypatch, tmp_path):
    """pretrained=smollm2 reaches lm-eval (and RULER's prompt builder, which reads the tokenizer from the model
    args) as the embedded model's local copy; paths, hub ids and other args pass unchanged."""
    import moba_hf.models as models

    monkeypatch.setattr(models, "local_path", lambda name: tmp_path / name)
    local = tmp_path / "smollm2"
    argv = ["--model", "hf-moba", "--model_args", "pretrained=smollm2,moba=training-free,dtype=float32"]
    assert _with_embedded_paths(argv)[3] == f"pretrained={local},moba=training-free,dtype=float32"
    assert _with_embedded_paths(["--model_args=tokenizer=smollm2,pretrained=org/smollm2"]) == [
        f"--model_args=tokenizer={local},pretrained=org/smollm2"
    ]
    given = ["--model_args", f"pretrained={tmp_path}"]
    assert _with_embedded_paths(given) == given


def _results(out) -> dict:
    files = sorted(out.rglob("results_*.json"))
    assert files, f"lm-eval wrote no results under {out}"
    return json.loads(files[-1].read_text())["results"]


def test_lm_eval_hf_moba_runs_our_tasks(task_dir, tmp_path):
    data = task_dir / "data"
    metadata = {"passkey_jsonl": str(data / "passkey.jsonl"), "niah_jsonl": str(data / "niah.jsonl")}
    model_args = f"pretrained={task_dir},dtype=float32,moba_block_size=16,moba_top_k=1"
    with track_sparsity() as stats:
        code = run_lm_eval(["--model", "hf-moba", "--model_args", model_args, "--tasks", "moba_passkey,moba_niah",
                            "--metadata", json.dumps(metadata), "--device", "cpu", "--limit", "2",
                            "--output_path", str(tmp_path / "out")])  # fmt: skip
    assert code == 0
    results = _results(tmp_path / "out")
    for task in ("moba_passkey", "moba_niah"):
        assert 0.0 <= results[task]["exact_match,first_integer"] <= 1.0
    # MoBA really ran inside lm-eval: block 16, top 1 on 64-96 token prompts skips most pairs
    assert stats.overall > 0.5 and set(stats.per_layer()) == {0, 1}


def test_lm_eval_plain_hf_with_attn_implementation_moba(task_dir, tmp_path):
    metadata = {"passkey_jsonl": str(task_dir / "data" / "passkey.jsonl")}
    with track_sparsity() as stats:
        code = run_lm_eval(["--model", "hf", "--model_args", f"pretrained={task_dir},attn_implementation=moba",
                            "--tasks", "moba_passkey", "--metadata", json.dumps(metadata), "--device", "cpu",
                            "--limit", "1", "--output_path", str(tmp_path / "out")])  # fmt: skip
    assert code == 0
    assert "moba_passkey" in _results(tmp_path / "out")
    assert stats.layers  # the "moba" attention function was called


@pytest.mark.slow  # RULER builds its word list and 500 prompts: about 30 s
def test_lm_eval_ruler_task_generates_offline_and_runs_moba(tiny_dir, tmp_path):
    """RULER's niah_single_1 (lm-eval's ruler extra, in our eval extra) builds its prompts here, with the
    checkpoint's tokenizer and nothing downloaded, and runs on hf-moba."""
    model_args = f"pretrained={tiny_dir},dtype=float32,moba_block_size=32,moba_top_k=2"
    with track_sparsity() as stats:
        code = run_lm_eval(["--model", "hf-moba", "--model_args", model_args, "--tasks", "niah_single_1",
                            "--metadata", json.dumps({"max_seq_lengths": [512]}), "--device", "cpu",
                            "--limit", "1", "--gen_kwargs", "max_gen_toks=4",
                            "--output_path", str(tmp_path / "out"), "--log_samples"])  # fmt: skip
    assert code == 0
    assert 0.0 <= _results(tmp_path / "out")["niah_single_1"]["512,none"] <= 1.0
    (samples,) = tmp_path.joinpath("out").rglob("samples_niah_single_1_*.jsonl")
    doc = json.loads(samples.read_text().splitlines()[0])["doc"]
    assert doc["max_length"] == 512 and doc["outputs"][0] in doc["input"]  # the needle's value is in the prompt
    assert stats.overall > 0.3  # block 32, top 2 over ~380-token prompts: MoBA ran inside lm-eval
