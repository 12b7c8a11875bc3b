"""Prompt families (passkey, prose-needle, kv-retrieval): length and depth rules, varied wording, seeds,
scoring, and the sweep / passkey grid reporting them side by side."""

import json
import re

import pytest

from moba_hf import MobaConfig, cli
from moba_hf.eval import families, sweep
from moba_hf.eval.families import FAMILIES, contexts, parse_families
from moba_hf.eval.families.contexts import NAMES
from moba_hf.eval.passkey import passkey_eval
from moba_hf.eval.run_records import TRIALS_FILE, RunMismatch
from moba_hf.eval.scoring import score_words

FAMILY_NAMES = list(families.ALL)  # the three above; tests/test_heldout_families.py covers the others


@pytest.mark.parametrize("name", FAMILY_NAMES)
@pytest.mark.parametrize("length", [150, 777, 2000])
def test_prompt_length_follows_the_documented_rule(tokenizer, name, length):
    family = FAMILIES[name]
    for trial, depth in enumerate([0.0, 0.3, 1.0]):
        n = len(family.prompt(tokenizer, 0, length, depth, trial).ids)
        if family.exact:
            assert n == length
        else:  # passkey: whole fillers, short by less than one of them
            assert length - 32 < n <= length


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_the_needle_sits_at_the_requested_depth(tokenizer, name):
    family = FAMILIES[name]
    for trial in range(3):
        for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
            prompt = family.prompt(tokenizer, 0, 1200, depth, trial)
            # the answer is spelled in the needle right where needle_token points
            assert prompt.expected in tokenizer.decode(prompt.ids[prompt.needle_token : prompt.needle_token + 40])
            # intro and question are under 6% of 1200 tokens; a sentence or filler (or kv's two other needles) 4%
            assert abs(prompt.needle_token / len(prompt.ids) - depth) < 0.08, (depth, prompt.needle_token)


def _kind(answer: str) -> str:
    if answer.isdigit():
        return f"{len(answer)} digits"
    return f"{len(answer.split())} words" if re.fullmatch(r"[A-Za-z ]+", answer) else "code"


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_wording_question_and_answer_format_vary_across_trials(tokenizer, name):
    prompts = [FAMILIES[name].prompt(tokenizer, 0, 300, 0.5, trial) for trial in range(16)]
    questions = set()
    for p in prompts:
        question = tokenizer.decode(p.ids[-12:]).split("?")[0]
        for word in NAMES:
            question = question.replace(word, "X")
        questions.add(question)
    assert len(questions) >= 3, questions
    assert len({_kind(p.expected) for p in prompts}) >= 2
    assert len({p.expected for p in prompts}) >= 12


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_prompts_are_reproducible_from_the_seed(tokenizer, name):
    family = FAMILIES[name]
    first = family.prompt(tokenizer, 3, 400, 0.5, 1)
    assert family.prompt(tokenizer, 3, 400, 0.5, 1) == first
    assert family.prompt(tokenizer, 4, 400, 0.5, 1).ids != first.ids
    assert family.prompt(tokenizer, 3, 400, 0.5, 2).ids != first.ids


@pytest.mark.parametrize(
    ("expected", "output", "correct"),
    [
        ("Oslo", " Oslo.", True),
        ("Oslo", "  OSLO, of course", True),
        ("Oslo", " Lima.", False),
        ("Oslo", "", False),
        ("silver heron", " Silver  Heron!", True),
        ("silver heron", " silver", False),
        ("481207", " 481207.\nThe", True),
        ("481207", " 4812070", False),
        ("4812", " 48121", False),
        ("a3f91c", " A3F91C", True),
        ("1955", " the year 1955", False),  # the answer must come first: exact, not contained
    ],
)
def test_scorer_accepts_the_answer_and_rejects_others(expected, output, correct):
    assert score_words(expected, output)[1] is correct


def test_family_names_and_lengths_are_checked(tokenizer):
    assert parse_families("kv-retrieval, passkey,passkey") == ["kv-retrieval", "passkey"]
    assert parse_families(None) == ["passkey", "prose-needle", "kv-retrieval"]
    with pytest.raises(ValueError, match="families must be names among passkey, prose-needle, kv-retrieval"):
        parse_families("passkey,essays")
    with pytest.raises(ValueError, match="to hold the prose-needle prompt"):
        families.check_fits(tokenizer, ["prose-needle"], [72, 4096])


def test_ranking_and_pareto_front_use_the_worst_family():
    def row(name, acc, sp):
        return sweep.SweepRow(name, None, {"passkey": {8: 1.0}, "prose-needle": {8: acc}}, {8: sp}, {8: 1.0}, None)

    rows = [row("dense", 1.0, 0.0), row("a", 0.4, 0.8), row("b", 0.9, 0.5), row("c", 0.3, 0.7)]
    assert rows[1].worst == {8: 0.4} and rows[1].worst_family == {8: "prose-needle"}
    assert sweep.pareto_front(rows, 8) == {"dense", "a", "b"}  # c loses to a on prose, though passkey ties
    assert sweep.ranking(rows, 8) == ["dense", "b", "a", "c"]


def test_sweep_reports_families_side_by_side_and_refuses_other_families(
    tiny_llama, tokenizer, tmp_path, one_thread, monkeypatch
):
    grid = [("sdpa", None), ("b16-k2", MobaConfig(block_size=16, top_k=2))]
    run = {"lengths": [128], "trials": 2, "text_ids": None, "out_dir": tmp_path, "batch": 2, "progress": False}
    rows = sweep.run_sweep(tiny_llama, tokenizer, grid, families=["prose-needle", "kv-retrieval"], **run)
    assert [set(r.accuracy) for r in rows] == [{"prose-needle", "kv-retrieval"}] * 2
    table = (tmp_path / "pareto.md").read_text().splitlines()
    head = [c.strip() for c in table[0].strip("|").split("|")]
    assert head[:3] == ["setting", "prose-needle 128", "kv-retrieval 128"] and "worst family @128" in head
    assert [line.split("|")[1].strip() for line in table[2:]] == ["sdpa", "b16-k2"]  # one row per setting
    trials = [json.loads(line) for line in (tmp_path / TRIALS_FILE).read_text().splitlines()]
    assert {t["prompt_tokens"] for t in trials if t["family"] == "prose-needle"} == {128}
    assert max(t["sparsity"] for t in trials if t["setting"] == "b16-k2") > 0.3
    assert sweep.pareto_plot(rows, 128, tmp_path / "pareto.png").stat().st_size > 1000
    with pytest.raises(RunMismatch, match=r"families=\[\"prose-needle\", \"kv-retrieval\"\], this run has families="):
        sweep.run_sweep(tiny_llama, tokenizer, grid, families=["prose-needle"], **run)
    monkeypatch.setattr(contexts, "PROSE_INTROS", ("Another intro.",))  # a new wording is another experiment
    with pytest.raises(RunMismatch, match="wording_sha1="):
        sweep.run_sweep(tiny_llama, tokenizer, grid, families=["prose-needle", "kv-retrieval"], **run)


def test_passkey_grid_over_families(tiny_llama, tokenizer, tmp_path, one_thread):
    result = passkey_eval(tiny_llama, tokenizer, ["sdpa"], lengths=[128], depths=[0.0, 1.0], trials=1, out_dir=tmp_path,
                          families="passkey,kv-retrieval", progress=False)  # fmt: skip
    assert {(r["family"], r["depth"]) for r in result.records} == {
        (f, d) for f in ("passkey", "kv-retrieval") for d in (0.0, 1.0)
    }
    assert "| setting | passkey @128 | kv-retrieval @128 | worst family @128 | sparsity @128 |" in result.summary
    assert (tmp_path / "kv-retrieval_heatmap.png").is_file()


def test_sweep_command_with_families(tiny_dir, tmp_path, capsys, one_thread):
    out = tmp_path / "sweep"
    argv = ["eval", "sweep", "--model", str(tiny_dir), "--attn", "sdpa", "--attn", "b16=moba:block_size=16,top_k=2",
            "--lengths", "128", "--trials", "1", "--ppl-length", "64", "--no-progress", "--out", str(out)]  # fmt: skip
    assert cli.main([*argv, "--families", "passkey,prose-needle"]) == 0
    printed = capsys.readouterr().out
    assert "| b16 |" in printed and "passkey 128 | prose-needle 128 |" in printed
    assert cli.main(argv) == 2  # the default is all three families: another experiment
    assert 'this run has families=["passkey", "prose-needle", "kv-retrieval"]' in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        cli.main([*argv, "--families", "passkey,essays"])
    assert "--families: families must be names among" in capsys.readouterr().err


def test_kv_retrieval_asks_for_one_of_three_needles(tokenizer):
    for trial in range(4):
        prompt = FAMILIES["kv-retrieval"].prompt(tokenizer, 0, 600, 0.5, trial)
        context, question = tokenizer.decode(prompt.ids).rsplit("\n\n", 1)
        assert len([k for k in NAMES if k in context]) == 3
        assert len([k for k in NAMES if k in question]) == 1
        assert context.count(prompt.expected) == 1


def test_passkey_command_with_families(tiny_dir, tmp_path, capsys, one_thread):
    argv = ["eval", "passkey", "--model", str(tiny_dir), "--attn", "sdpa", "--depths", "0.5", "--trials", "1",
            "--families", "kv-retrieval", "--no-progress", "--out", str(tmp_path / "p")]  # fmt: skip
    assert cli.main([*argv, "--lengths", "128"]) == 0
    assert "| `sdpa` | 0." in capsys.readouterr().out and (tmp_path / "p" / "kv-retrieval_heatmap.png").is_file()
    assert cli.main([*argv, "--lengths", "64"]) == 2
    assert "--lengths: lengths must be >= 128 tokens to hold the kv-retrieval prompt" in capsys.readouterr().err
