"""Our passkey / NIAH tasks through lm-evaluation-harness, with "moba" registered by `moba-hf lm-eval`."""

import importlib.util
import json

import pytest

from moba_hf.config import MobaConfig
from moba_hf.eval.harness import TASKS_DIR, _moba_from_args, run_lm_eval, write_task_data
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
