"""The ten families beyond passkey, prose-needle and kv-retrieval (`moba_hf.eval.families`): exact length, the
needle at the documented depth, seeded prompts, scoring on every word of the answer, the registry's splits, and
`--families` taking their names."""

import json
import re

import pytest

from moba_hf import cli
from moba_hf.eval import families
from moba_hf.eval.families import FAMILIES, SPLITS, lookup, parse_families, text_params
from moba_hf.eval.scoring import score_words

NEW = [name for name in FAMILIES if name not in families.ALL]


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("length", [300, 777, 2000])
def test_prompts_are_exactly_the_requested_length(tokenizer, name, length):
    family = FAMILIES[name]
    assert family.exact
    for trial, depth in enumerate([0.0, 0.3, 1.0]):
        assert len(family.prompt(tokenizer, 0, length, depth, trial).ids) == length


@pytest.mark.parametrize("name", NEW)
def test_the_needle_sits_at_the_requested_depth(tokenizer, name):
    family = FAMILIES[name]
    for trial in range(3):
        for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
            prompt = family.prompt(tokenizer, 0, 1200, depth, trial)
            window = tokenizer.decode(prompt.ids[prompt.needle_token : prompt.needle_token + 40])
            # the answer is spelled in the needle right where needle_token points
            assert re.match(rf"\s*[^\n]*\b{re.escape(prompt.expected)}\b", window), window
            # the intro (question-first: with the question) and multi-needle-one's other needles are under 8% of
            # 1200 tokens, a sentence or a line under 5%
            assert abs(prompt.needle_token / len(prompt.ids) - depth) < 0.1, (depth, prompt.needle_token)


def test_multi_needle_one_asks_for_one_of_three_colours(tokenizer):
    for trial in range(6):
        prompt = FAMILIES["multi-needle-one"].prompt(tokenizer, 0, 900, 0.5, trial)
        context = tokenizer.decode(prompt.ids[:-20])
        values = re.findall(r"\b\d{4,7}\b", context)
        assert len(set(values)) == 3 and prompt.expected in values


def test_multi_label_one_asks_for_one_of_three_labelled_codes(tokenizer):
    for trial in range(6):
        prompt = FAMILIES["multi-label-one"].prompt(tokenizer, 0, 900, 0.5, trial)
        text = tokenizer.decode(prompt.ids)
        needles = dict(re.findall(r"\* Reminder: the ([\w ]+?) is (\d+)\.", text))
        assert len(needles) == 3 and len(set(needles.values())) == 3
        asked = re.search(r"the ([\w ]+?)\? (?:Answer: t|T)he \1 is$", text).group(1)
        assert needles[asked] == prompt.expected
        assert tokenizer.decode(prompt.ids[prompt.needle_token :]).startswith(f"\n* Reminder: the {asked} is")


@pytest.mark.parametrize(
    ("name", "needle"),
    [("log-lookup", r"\[WARN\] vault: the ([\w ]+?) is (\d+)\. Repeat: the \1 is \2\."),
     ("chat-lookup", r"(?:Gwen|Hugo|Iris|Jonas): the ([\w ]+?) is (\d+), I repeat, \2\."),
     ("manual-lookup", r"Important: the ([\w ]+?) is (\d+)\. Write it down: \2\.")],
)  # fmt: skip
def test_lookup_families_hold_one_number_in_a_haystack_without_digits(tokenizer, name, needle):
    for trial in range(6):
        prompt = FAMILIES[name].prompt(tokenizer, 0, 900, 0.5, trial)
        text = tokenizer.decode(prompt.ids)
        (label, value), *more = re.findall(needle, text)
        assert not more and value == prompt.expected
        # the question names the needle's label; the haystack around the needle has no digit at all
        assert re.search(rf"\b{label}\b[^\n]*\? (?:Answer: t|T)he {label} is$", text), text[-120:]
        assert not re.search(r"\d", re.sub(needle, "", text))


def test_question_first_asks_before_and_after_the_document(tokenizer):
    for trial in range(6):
        text = tokenizer.decode(FAMILIES["question-first"].prompt(tokenizer, 0, 900, 0.5, trial).ids)
        questions = re.findall(r"Question: ([^\n]+\?)", text)
        assert len(questions) == 2 and questions[0] == questions[1]
        assert text.index("Document:") < text.rindex("Question:")


@pytest.mark.parametrize("name", NEW)
def test_prompts_are_reproducible_from_seed_length_depth_and_trial(tokenizer, name):
    family = FAMILIES[name]
    first = family.prompt(tokenizer, 3, 400, 0.5, 1)
    assert family.prompt(tokenizer, 3, 400, 0.5, 1) == first
    for other in [(4, 400, 0.5, 1), (3, 401, 0.5, 1), (3, 400, 0.25, 1), (3, 400, 0.5, 2)]:
        assert family.prompt(tokenizer, *other).ids != first.ids, other


@pytest.mark.parametrize("name", NEW)
def test_wordings_and_answers_vary_across_trials(tokenizer, name):
    prompts = [FAMILIES[name].prompt(tokenizer, 0, 300, 0.5, trial) for trial in range(16)]
    assert len({p.expected for p in prompts}) >= 12
    questions = {re.sub(r"\b[A-Z][a-z]+ [A-Z][a-z]+\b|\b[A-Z]{3}\b|\b(red|blue|green|yellow|purple|orange|white|black)"
                        r"\b|\b\w+_\w+\b", "X", tokenizer.decode(p.ids[-14:])) for p in prompts}  # fmt: skip
    assert len(questions) >= 2, questions


@pytest.mark.parametrize(
    ("expected", "output", "correct"),
    [
        ("583921", " 583921.", True),
        ("583921", ' "583921"  # SECRET', True),
        ("583921", " 583", False),  # the first 3 of 6 digits
        ("583921", " 583 921", False),
        ("583921", " 5839210", False),
        ("7f3a-91c2-4be0", " 7F3A-91C2-4BE0.", True),
        ("7f3a-91c2-4be0", " 7f3a-91c2", False),  # two of three groups
        ("7f3a-91c2-4be0", " 7f3a-91c2-4be1", False),
        ("golden heron", " golden heron.", True),
        ("golden heron", " golden", False),
        ("golden heron", " heron", False),
        ("Biscuit", " Biscuit; the cat", True),
        ("Biscuit", " the cat Biscuit", False),
    ],
)
def test_scorer_takes_every_word_of_the_answer(expected, output, correct):
    assert score_words(expected, output)[1] is correct
    for name in (*families.ALL, *NEW):  # one rule for every family
        assert FAMILIES[name].score(expected, output)[1] is correct


def test_every_family_is_registered_with_a_split():
    assert set(NEW) <= set(FAMILIES) and len(NEW) >= 6
    assert set(SPLITS) == set(FAMILIES) and set(SPLITS.values()) == {"tuning", "heldout"}
    assert all(SPLITS[name] == "tuning" for name in families.ALL)
    assert sum(SPLITS[name] == "heldout" for name in NEW) >= 3
    assert all(FAMILIES[name].split == SPLITS[name] for name in NEW)
    assert families.ALL == ("passkey", "prose-needle", "kv-retrieval")  # the sweep's default stays the three
    with pytest.raises(ValueError, match="split must be one of tuning, heldout, got 'test'"):
        families.Family("x", FAMILIES["code-needle"].build, 8, True, split="test")


def test_family_names_parse_and_lengths_are_checked(tokenizer):
    assert parse_families(",".join(["passkey", *NEW])) == ["passkey", *NEW]
    with pytest.raises(ValueError, match="to hold the question-first prompt"):
        families.check_fits(tokenizer, ["question-first"], [60, 4096])
    with pytest.raises(ValueError, match="no room for the code-needle context"):
        FAMILIES["code-needle"].prompt(tokenizer, 0, 30, 0.5, 0)


def test_an_unknown_family_is_refused_naming_every_family(capsys):
    with pytest.raises(ValueError, match=r"got 'passkey,essays' \(unknown: essays\)") as error:
        parse_families("passkey,essays")
    listed = str(error.value).split(", got")[0].removeprefix("families must be names among ").split(", ")
    assert listed == list(FAMILIES)
    with pytest.raises(SystemExit) as done:  # the command line: one line, exit 2, before any model loads
        cli.main(["eval", "sweep", "--families", "word-passkey,essays"])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and "\n" not in err and "--families" in err and "essays" in err
    assert all(name in err for name in FAMILIES), err


@pytest.mark.parametrize(
    ("task", "default"),
    [
        ("sweep", "default: passkey,prose-needle,kv-retrieval"),
        ("passkey", "default: none: the fixed Landmark passkey prompt"),
    ],
)
def test_help_lists_every_family_by_split(task, default, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        cli.main(["eval", task, "--help"])
    printed = capsys.readouterr().out
    entry = printed[printed.index("\n  --families LIST") + 1 :]  # the option's entry, not the usage line
    text = " ".join(entry[: entry.find("\n  --", 1)].split())
    tuning, heldout = text.index("tuning ("), text.index("heldout (")
    for name in FAMILIES:
        assert re.search(rf"\s{re.escape(name)}\s+\(", entry), name  # whole, never broken at a hyphen
        at = text.index(f" {name} (")
        assert (tuning < at < heldout) if SPLITS[name] == "tuning" else heldout < at, name
        assert f"{name} ({FAMILIES[name].about})" in text
    assert text.endswith(default), text


def test_every_family_has_a_help_line():
    assert all(family.about for family in FAMILIES.values())
    splits = families.by_split()
    assert splits == {split: [n for n in FAMILIES if SPLITS[n] == split] for split in ("tuning", "heldout")}


def test_families_of_one_context_share_its_tokenized_units(tokenizer):
    from moba_hf.eval.families import contexts

    prose = contexts.unit_ids(tokenizer, "prose")  # prose-needle's and question-first's haystack, tokenized once
    assert contexts.unit_ids(tokenizer, "prose") is prose and len(prose) > 100
    with pytest.raises(ValueError, match="source must be one of prose, story, landmark, .*, got 'poems'"):
        contexts.unit_ids(tokenizer, "poems")


def test_the_wording_digests_are_the_ones_run_directories_hold():
    # run.json pins a run's wordings by these hashes: a table rewritten in another form (same strings) must keep
    # them, or every earlier --out directory would be refused on resume
    assert families.wording_digest() == "d46015d1c9f068ee"
    assert len(families.other_wording_digest()) == 16  # it also hashes the code haystack, which varies with Python


def test_a_resume_after_a_wording_change_is_refused(monkeypatch):
    base = text_params(["passkey"])
    assert "heldout_wording_sha1" not in base and "prose_sha1" not in base
    mine = text_params(["passkey", "code-needle"])
    assert mine["heldout_wording_sha1"] == families.other_wording_digest()
    assert "prose_sha1" in text_params(["question-first"])
    monkeypatch.setattr(lookup, "CODE_NAMES", ("OTHER_NAME",))
    assert text_params(["code-needle"])["heldout_wording_sha1"] != mine["heldout_wording_sha1"]


def test_sweep_command_takes_the_new_families(tiny_dir, tmp_path, capsys, one_thread):
    out = tmp_path / "sweep"
    argv = ["eval", "sweep", "--model", str(tiny_dir), "--attn", "sdpa", "--lengths", "400", "--trials", "1",
            "--ppl-length", "64", "--no-progress", "--out", str(out), "--families", ",".join(NEW)]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert all(f"{name} 400" in printed for name in NEW), printed
    trials = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    assert {t.get("family") for t in trials if "family" in t} == set(NEW)
