"""The training-free sweep (issue 8) on a tiny random Llama with the embedded tokenizer."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from moba_hf import MobaConfig
from moba_hf.eval import sweep
from moba_hf.eval.passkey import passkey_line


@pytest.fixture(scope="module")
def tiny(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_prompts_have_exact_length_and_the_needle_at_its_depth(tokenizer):
    prompts = sweep.passkey_token_prompts(tokenizer, 300, [0.0, 0.5, 1.0], [11111, 22222, 33333])
    assert prompts.shape == (3, 300)
    needle = tokenizer(" " + passkey_line(22222), add_special_tokens=False).input_ids
    row = prompts[1].tolist()
    starts = [i for i in range(300 - len(needle)) if row[i : i + len(needle)] == needle]
    assert len(starts) == 1 and 100 < starts[0] < 200
    text = tokenizer.decode(prompts[2])
    assert text.rstrip().endswith("What is the pass key? The pass key is")
    with pytest.raises(ValueError, match="length=20 is too short"):
        sweep.passkey_token_prompts(tokenizer, 20, [0.5], [12345])


def test_pareto_front_keeps_only_undominated_settings():
    def row(name, acc, sp):
        return sweep.SweepRow(name, None, {8: acc}, {8: sp}, {8: 1.0}, None)

    rows = [row("dense", 1.0, 0.0), row("a", 0.8, 0.7), row("b", 0.6, 0.6), row("c", 0.2, 0.9), row("d", 0.8, 0.5)]
    rows.append(sweep.SweepRow("broken", None, {}, {}, {}, None, error="RuntimeError: x"))
    assert sweep.pareto_front(rows, 8) == {"dense", "a", "c"}


def test_sweep_writes_table_plot_and_resumes(tiny, tokenizer, tmp_path):
    grid = [("sdpa", None), ("b16-k2", MobaConfig(block_size=16, top_k=2)), ("bad", MobaConfig(full_attn_layers=9))]
    text = torch.randint(0, len(tokenizer), (1, 96))
    rows = sweep.run_sweep(
        tiny, tokenizer, grid, lengths=[64, 96], trials=2, text_ids=text, out_dir=tmp_path, batch=2, progress=False
    )
    by_name = {r.name: r for r in rows}
    assert by_name["sdpa"].sparsity[96] == 0.0
    assert by_name["b16-k2"].sparsity[96] == pytest.approx(MobaConfig(block_size=16, top_k=2).theoretical_sparsity(96))
    assert by_name["b16-k2"].ppl is not None and by_name["b16-k2"].error is None
    assert "full_attn_layers=9 exceeds" in by_name["bad"].error
    table = (tmp_path / "pareto.md").read_text()
    assert "| b16-k2 |" in table and "failed: ValueError" in table
    sweep.pareto_plot(rows, 96, tmp_path / "pareto.png")
    assert (tmp_path / "pareto.png").stat().st_size > 1000

    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["name"] for r in saved["rows"]] == ["sdpa", "b16-k2", "bad"]
    calls = []
    original = sweep.batched_passkey
    sweep.batched_passkey = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        sweep.run_sweep(
            tiny, tokenizer, grid, lengths=[64, 96], trials=2, text_ids=text, out_dir=tmp_path, batch=2, progress=False
        )
    finally:
        sweep.batched_passkey = original
    assert calls == []  # finished settings are not run again; the failed one fails again before any trial

    # a resumed run whose last rows are all reused still writes every row of its grid
    sweep.run_sweep(
        tiny, tokenizer, grid[::-1][1:], lengths=[64, 96], trials=2, text_ids=text, out_dir=tmp_path, progress=False
    )
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["name"] for r in saved["rows"]] == ["b16-k2", "sdpa"]


def test_grid_entries_from_setting_strings():
    name, cfg = sweep.grid_entry("fine-dense-decode=moba:block_size=64,top_k=12,decode=full,pooling=bound")
    assert name == "fine-dense-decode"
    assert cfg == MobaConfig(block_size=64, top_k=12, decode="full", pooling="bound")
    assert sweep.grid_entry("sdpa") == ("sdpa", None)
    assert sweep.grid_entry("moba") == ("moba", MobaConfig())
    with pytest.raises(ValueError, match="compares 'sdpa' with MoBA settings; got attn_implementation 'eager'"):
        sweep.grid_entry("eager")
