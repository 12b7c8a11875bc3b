"""The training-free sweep on a tiny_llama random Llama with the embedded tokenizer."""

import json

import pytest
import torch

from moba_hf import MobaConfig, cli
from moba_hf.eval import sweep
from moba_hf.eval.families import FAMILIES
from moba_hf.eval.run_records import TRIALS_FILE, RunMismatch
from moba_hf.prompts import WORDINGS, build_prompt, passkey_line


def test_the_sweep_uses_the_passkey_prompt_builder(tokenizer):
    cells = sweep.sweep_cells([300], 3, 96, ["passkey", "kv-retrieval"])
    passkey = [c for c in cells if c.get("family") == "passkey"]
    assert [c["depth"] for c in passkey] == [0.5 / 3, 1.5 / 3, 2.5 / 3]
    assert len([c for c in cells if c.get("family") == "kv-retrieval"]) == 3
    prompt = FAMILIES["passkey"].prompt(tokenizer, 0, 300, passkey[1]["depth"], 1)
    wording = next(
        w for w in range(len(WORDINGS)) if passkey_line(int(prompt.expected), w) in tokenizer.decode(prompt.ids)
    )
    text = build_prompt(tokenizer, 300, passkey[1]["depth"], int(prompt.expected), wording=wording)
    assert prompt.ids == tokenizer(text).input_ids and len(prompt.ids) <= 300
    assert cells[-1] == {"task": "ppl", "length": 96}


def test_pareto_front_keeps_only_undominated_settings():
    def row(name, acc, sp):
        return sweep.SweepRow(name, None, {"passkey": {8: acc}}, {8: sp}, {8: 1.0}, None)

    rows = [row("dense", 1.0, 0.0), row("a", 0.8, 0.7), row("b", 0.6, 0.6), row("c", 0.2, 0.9), row("d", 0.8, 0.5)]
    rows.append(sweep.SweepRow("broken", None, {"passkey": {}}, {}, {}, None, error="RuntimeError: x"))
    assert sweep.pareto_front(rows, 8) == {"dense", "a", "c"}


def test_sweep_writes_table_plot_and_resumes(tiny_llama, tokenizer, tmp_path, one_thread):
    grid = [("sdpa", None), ("b16-k2", MobaConfig(block_size=16, top_k=2)), ("bad", MobaConfig(full_attn_layers=9))]
    text = torch.randint(0, len(tokenizer), (1, 96))
    run = {"lengths": [112, 128], "trials": 2, "text_ids": text, "out_dir": tmp_path, "batch": 2, "progress": False,
           "families": ["prose-needle"]}  # fmt: skip
    rows = sweep.run_sweep(tiny_llama, tokenizer, grid, **run)
    by_name = {r.name: r for r in rows}
    assert by_name["sdpa"].sparsity[128] == 0.0
    trials = [json.loads(line) for line in (tmp_path / TRIALS_FILE).read_text().splitlines()]
    tokens = {t["prompt_tokens"] for t in trials if t["setting"] == "b16-k2" and t["length"] == 128}
    expected = [MobaConfig(block_size=16, top_k=2).theoretical_sparsity(n) for n in tokens]
    assert by_name["b16-k2"].sparsity[128] == pytest.approx(sum(expected) / len(expected))
    assert by_name["b16-k2"].ppl is not None and by_name["b16-k2"].error is None
    assert "full_attn_layers=9 exceeds" in by_name["bad"].error
    assert {t["batch"] for t in trials if "family" in t} == {2}  # both trials of a length in one forward
    table = (tmp_path / "pareto.md").read_text()
    assert "| b16-k2 |" in table and "failed: ValueError" in table
    sweep.pareto_plot(rows, 128, tmp_path / "pareto.png")
    assert (tmp_path / "pareto.png").stat().st_size > 1000

    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["name"] for r in saved["rows"]] == ["sdpa", "b16-k2", "bad"]
    calls = []
    original = sweep.greedy_decode
    sweep.greedy_decode = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        sweep.run_sweep(tiny_llama, tokenizer, grid, **run)
    finally:
        sweep.greedy_decode = original
    assert calls == []  # finished settings are not run again; the failed one fails again before any trial

    # a resumed run whose last rows are all reused still writes every row of its grid
    sweep.run_sweep(tiny_llama, tokenizer, grid[::-1][1:], **run)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["name"] for r in saved["rows"]] == ["b16-k2", "sdpa"]


@pytest.mark.parametrize(
    "change", [{"trials": 3}, {"lengths": [128]}, {"batch": 1}, {"text_ids": None}, {"families": ["passkey"]}]
)
def test_sweep_resume_refuses_other_parameters(tiny_llama, tokenizer, tmp_path, change, one_thread):
    run = {"lengths": [128, 160], "trials": 1, "text_ids": torch.arange(64)[None], "out_dir": tmp_path, "batch": 2,
           "progress": False, "families": ["passkey", "kv-retrieval"]}  # fmt: skip
    sweep.run_sweep(tiny_llama, tokenizer, [("sdpa", None)], **run)
    name = next(iter(change)).replace("text_ids", "ppl_sha1")
    with pytest.raises(RunMismatch, match=f"{name}=.*this run has {name}="):
        sweep.run_sweep(tiny_llama, tokenizer, [("sdpa", None)], **{**run, **change})


def test_sweep_command(tiny_dir, tmp_path, capsys, one_thread):
    text = tmp_path / "doc.txt"
    text.write_text("A long enough document for the perplexity column. " * 40)
    out = tmp_path / "sweep"
    argv = ["eval", "sweep", "--model", str(tiny_dir), "--attn", "sdpa", "--attn", "b16=moba:block_size=16,top_k=2",
            "--lengths", "128", "--trials", "2", "--batch", "2", "--text", str(text), "--ppl-length", "96",
            "--families", "passkey", "--out", str(out), "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    assert "| b16 |" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} >= {"run.json", "trials.jsonl", "results.json", "pareto.md", "pareto.png"}
    assert cli.main([*argv[:-3], "--trials", "3", "--out", str(out), "--no-progress"]) == 2
    assert "trials=2, this run has trials=3" in capsys.readouterr().err


def test_grid_entries_from_setting_strings():
    name, cfg = sweep.grid_entry("fine-dense-decode=moba:block_size=64,top_k=12,decode=full,pooling=bound")
    assert name == "fine-dense-decode"
    assert cfg == MobaConfig(block_size=64, top_k=12, decode="full", pooling="bound")
    assert sweep.grid_entry("sdpa") == ("sdpa", None)
    assert sweep.grid_entry("moba") == ("moba", MobaConfig())
    with pytest.raises(ValueError, match="compares 'sdpa' with MoBA settings; got attn_implementation 'eager'"):
        sweep.grid_entry("eager")
    assert sweep.grid_entry("b64-k12-f3") == ("b64-k12-f3", MobaConfig(block_size=64, top_k=12, full_attn_layers=3))
    dense_first = MobaConfig(
        block_size=64, top_k=5, full_attn_layer_ids=(0, 1), pooling="bound", sink_blocks=1, local_blocks=1,
        dense_tail=64,
    )  # fmt: skip
    assert sweep.grid_entry("b64-k5-f0-dense0+1-poolingbound-sink1-local1-tail64")[1] == dense_first


def test_sweep_resume_refuses_other_weights_under_the_same_name(tokenizer, tmp_path, one_thread):
    """The sweep resumes by the evaluations' one rule: the weights are fingerprinted, not only named."""
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    run = {"lengths": [128], "trials": 1, "text_ids": None, "out_dir": tmp_path, "batch": 1, "progress": False,
           "families": ["passkey"], "model_name": "mine"}  # fmt: skip
    sweep.run_sweep(model, tokenizer, [("sdpa", None)], **run)
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    with pytest.raises(RunMismatch, match='model.weights="params:sha256:.*this run has model.weights="params:sha256:'):
        sweep.run_sweep(model, tokenizer, [("sdpa", None)], **run)
    rows = sweep.run_sweep(model, tokenizer, [("sdpa", None)], **run, allow_changed=True)
    assert rows[0].error is None
    saved = json.loads((tmp_path / "results.json").read_text())
    assert list(saved["changes"][0]["differences"]) == ["model.weights"]
