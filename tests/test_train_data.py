"""Training data: packing layout, readers, the synthetic retrieval generator, and no attention across documents."""

import json
from pathlib import Path

import pytest
import torch
from tiny_models import TRAIN, tiny_model

import moba_hf
from moba_hf.integration.layout import document_ids
from moba_hf.prompts import QUESTION, build_prompt, passkey_line
from moba_hf.train import Document, TrainConfig, build_dataset, collate, pack, read_documents
from moba_hf.train.data import IGNORE
from moba_hf.train.synthetic import TEMPLATES

pytestmark = pytest.mark.usefixtures("one_thread")


def doc(*ids):
    return Document(list(ids), list(ids))


def test_pack_split_documents_layout():
    rows = pack([doc(1, 2, 3), doc(4, 5, 6, 7, 8), doc(9)], 4, pad_id=0)
    assert [r["input_ids"].tolist() for r in rows] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 0, 0]]
    # positions restart per document; a document cut at a row end continues its positions
    assert [r["position_ids"].tolist() for r in rows] == [[0, 1, 2, 0], [1, 2, 3, 4], [0, 0, 1, 2]]
    # each document's first token and all padding are unlabelled
    assert [r["labels"].tolist() for r in rows] == [[-100, 2, 3, -100], [5, 6, 7, 8], [-100, -100, -100, -100]]


def test_pack_whole_documents_layout():
    rows = pack([doc(1, 2, 3), doc(4, 5), doc(6, 7, 8, 9, 10, 11)], 5, split_documents=False, pad_id=0)
    assert [r["input_ids"].tolist() for r in rows] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]  # last one truncated
    assert [r["position_ids"].tolist() for r in rows] == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    rows = pack([doc(1, 2, 3), doc(4, 5, 6)], 5, split_documents=False, pad_id=0)
    assert [r["input_ids"].tolist() for r in rows] == [[1, 2, 3, 0, 0], [4, 5, 6, 0, 0]]
    assert rows[0]["labels"].tolist() == [IGNORE, 2, 3, IGNORE, IGNORE]


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="seq_len"):
        pack([doc(1, 2)], 1)
    with pytest.raises(ValueError, match="labels"):
        pack([Document([1, 2], [1])], 4)


def test_collate_and_document_ids_match_layout():
    batch = collate(pack([doc(1, 2, 3), doc(4, 5, 6, 7, 8), doc(9)], 4))
    assert batch["input_ids"].shape == batch["position_ids"].shape == (3, 4)
    # the documents the attention splits each row into: [a a a | b] [b b b b] [c | pad pad pad]
    assert document_ids(batch["position_ids"]).tolist() == [[0, 0, 0, 1], [0, 0, 0, 0], [0, 1, 1, 1]]


def test_read_documents_text_jsonl_and_token_ids(tmp_path):
    class Tok:
        eos_token_id = 99

        def __call__(self, text, add_special_tokens=False):
            return type("Enc", (), {"input_ids": [len(w) for w in text.split()]})()

    (tmp_path / "a.txt").write_text("one two\n\nthree\n")
    assert [d.input_ids for d in read_documents(str(tmp_path / "a.txt"), Tok())] == [[3, 3, 99], [5, 99]]
    (tmp_path / "b.jsonl").write_text(json.dumps({"body": "four"}) + "\n\n" + json.dumps({"body": "a bc"}) + "\n")
    assert [d.input_ids for d in read_documents(str(tmp_path / "b.jsonl"), Tok(), text_field="body")] == [
        [4, 99],
        [1, 2, 99],
    ]
    with pytest.raises(ValueError, match="text_field='text'"):
        read_documents(str(tmp_path / "b.jsonl"), Tok())
    (tmp_path / "c.jsonl").write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    assert read_documents(str(tmp_path / "c.jsonl"), None)[0].input_ids == [5, 6, 7]
    with pytest.raises(ValueError, match="tokenizer"):
        read_documents(str(tmp_path / "a.txt"), None)


def test_rows_without_a_target_are_refused_or_dropped(tmp_path, caplog):
    """A row whose labels[1:] are all IGNORE trains nothing (loss 0, grad_norm 0, Adam still moves): none at
    all is refused, some are dropped with one warning that counts them."""
    answer_last = {"input_ids": list(range(1, 11)), "labels": [IGNORE] * 9 + [10]}  # a target only at token 9
    (tmp_path / "d.jsonl").write_text(json.dumps(answer_last) + "\n")

    def dataset(**data):
        return build_dataset(TrainConfig.from_dict({"data": {"source": str(tmp_path / "d.jsonl"), **data}}), None)

    with pytest.raises(ValueError, match=r"data.seq_len=8 leaves no trainable target in any of the 1 packed rows"):
        dataset(seq_len=8, split_documents=False)  # the document is cut to 8 tokens, before its target
    with pytest.raises(ValueError, match=r"use data.seq_len >= 10 .* or data.split_documents = true"):
        dataset(seq_len=8, split_documents=False)
    assert len(dataset(seq_len=10, split_documents=False)) == 1
    with caplog.at_level("WARNING", logger="moba_hf"):
        rows = dataset(seq_len=4)  # rows [1-4] [5-8] [9 10 pad pad]: only the last holds the target
    assert [r["input_ids"].tolist() for r in rows] == [[9, 10, 0, 0]]
    assert [m for m in caplog.messages if "packed rows" in m] == [
        "moba_hf: dropped 2 of 3 packed rows that hold no trainable target at data.seq_len=4"
    ]
    (tmp_path / "d.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3], "labels": [IGNORE] * 3}) + "\n")
    with pytest.raises(ValueError, match="no document has a trainable target"):
        dataset(seq_len=4)


def test_a_target_at_row_position_zero_does_not_count():
    """The loss shifts labels by one, so a label at a row's first position is never predicted."""
    from moba_hf.train.data import has_target

    row = pack([Document([1, 2, 3, 4, 5], [IGNORE] * 4 + [5])], 4)[1]
    assert row["labels"].tolist() == [5, IGNORE, IGNORE, IGNORE] and not has_target(row)


@pytest.mark.slow
def test_the_cpu_demo_at_seq_len_8_is_refused(tokenizer):
    """The retrieval mixture trains on answers at each document's end: 8-token rows would hold none."""
    demo = TrainConfig.from_file(Path(__file__).parent.parent / "configs" / "train_cpu_demo.toml")
    config = demo.replace("data", seq_len=8, num_documents=4)
    with pytest.raises(ValueError, match=r"data.seq_len=8 leaves no trainable target .* data.seq_len >= \d+"):
        build_dataset(config, tokenizer)


def test_template_zero_is_the_passkey_eval_wording():
    key_line, question = TEMPLATES[0]
    assert key_line.format(key=48213) == passkey_line(48213)
    assert question == QUESTION


@pytest.mark.slow
def test_retrieval_document_matches_eval_prompt():
    from moba_hf.models import load
    from moba_hf.train.synthetic import retrieval_document, retrieval_mixture

    _, tok = load("smollm2")
    d = retrieval_document(tok, 300, 0.5, 12345)
    prompt = tok(build_prompt(tok, 300 - 7, 0.5, 12345)).input_ids
    answer = tok(" 12345.", add_special_tokens=False).input_ids
    assert d.input_ids == prompt + answer and len(d.input_ids) <= 300
    assert [t for t in d.labels if t != IGNORE] == answer
    docs = retrieval_mixture(tok, 6, min_length=100, max_length=200, seed=3)
    assert all(100 - 25 <= len(x.input_ids) <= 200 for x in docs)
    assert docs[0].input_ids == retrieval_mixture(tok, 6, min_length=100, max_length=200, seed=3)[0].input_ids


PROBE_ARCHS = ("llama", "qwen3")


def tiny(arch, attn):
    moba = moba_hf.MobaConfig(block_size=8, top_k=2) if attn == "moba" else None
    return tiny_model(arch, moba, dtype=torch.float32, head_dim=16, **TRAIN)


def assert_documents_apart(model):
    """Probe: in a packed row [A | B | C], changing A's tokens leaves B's and C's logits unchanged, and B's
    logits equal those of B run alone. Blocks (8) straddle the document boundaries (13, 30)."""
    lengths = (13, 17, 10)
    row = collate(pack([doc(*torch.randint(0, 128, (n,)).tolist()) for n in lengths], sum(lengths)))
    row.pop("labels")
    changed = {k: v.clone() for k, v in row.items()}
    changed["input_ids"][0, :13] = torch.randint(0, 128, (13,))
    with torch.no_grad():
        logits = model(**row, use_cache=False).logits[0]
        logits_changed = model(**changed, use_cache=False).logits[0]
        alone_b = model(input_ids=row["input_ids"][:, 13:30], use_cache=False).logits[0]
    assert not torch.allclose(logits[:13], logits_changed[:13])  # the probe does reach document A
    # exact: B's and C's arithmetic sees A only through masked scores, whose weights are exactly 0
    torch.testing.assert_close(logits_changed[13:], logits[13:], rtol=0, atol=0)
    # B alone runs other shapes, so other summation orders over at most 128 terms (intermediate_size):
    # 128 eps of the largest logit (measured: 1.2e-7 of 0.57, ~30x inside)
    atol = 128 * torch.finfo(torch.float32).eps * alone_b.abs().max().item()
    torch.testing.assert_close(logits[13:30], alone_b, rtol=0, atol=atol)


@pytest.mark.parametrize("attn", ["moba", "sdpa"])
@pytest.mark.parametrize("arch", PROBE_ARCHS)
def test_packed_row_never_attends_across_documents(arch, attn):
    assert_documents_apart(tiny(arch, attn))


def probe_distributed() -> None:
    """`torchrun --nproc_per_node 2 tests/test_train_data.py --distributed`: the probe with the model wrapped in
    DDP, and with every decoder layer and the model sharded by fully_shard (FSDP2), over gloo;
    tests/test_train_distributed.py runs it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    for arch in PROBE_ARCHS:
        for attn in ("moba", "sdpa"):
            torch.manual_seed(0)  # the same weights and rows on every rank
            assert_documents_apart(DistributedDataParallel(tiny(arch, attn)))
            torch.manual_seed(0)
            model = tiny(arch, attn)
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "DTensor"
            assert_documents_apart(model)
    print(f"rank {dist.get_rank()}: probe passed under DDP and FSDP2", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--distributed"]:
        torch.set_num_threads(1)
        probe_distributed()


def token_file(tmp_path, *records):
    path = tmp_path / "ids.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    ("record", "shown"),
    [
        ({"input_ids": [1, 2, 128]}, "input_ids[2] = 128"),  # == vocab_size: one past the embedding
        ({"input_ids": [1, -1, 2]}, "input_ids[1] = -1"),
        ({"input_ids": [1, 2.0, 3]}, "input_ids[1] = 2.0"),
        ({"input_ids": [1, "2"]}, "input_ids[1] = '2'"),
        ({"input_ids": [True, 2]}, "input_ids[0] = True"),
        ({"input_ids": [1, 2], "labels": [-100, 500]}, "labels[1] = 500"),
    ],
)
def test_token_ids_are_checked_when_the_data_loads(tmp_path, record, shown):
    path = token_file(tmp_path, {"input_ids": [5, 6, 7]}, record)
    config = TrainConfig.from_dict({"data": {"source": str(path), "seq_len": 4}})
    with pytest.raises(ValueError) as err:
        build_dataset(config, None, vocab_size=128)
    assert str(err.value).startswith(f"{path}:2: {shown} is no token id of this model; valid: integers in [0, 128)")


def test_out_of_vocabulary_ids_stop_the_run_before_a_checkpoint(tmp_path):
    from tiny_models import train_model

    from moba_hf.train import train

    path = token_file(tmp_path, *[{"input_ids": list(range(i, i + 20))} for i in range(4)], {"input_ids": [7, 130]})
    config = TrainConfig.from_dict(
        {
            "data": {"source": str(path), "seq_len": 16},
            "train": {"max_steps": 6, "save_steps": 2, "output_dir": str(tmp_path / "out"), "save": False},
        }
    )
    with pytest.raises(ValueError, match=rf"{path}:5: input_ids\[1\] = 130 is no token id .* \[0, 128\)"):
        train(config, model=train_model())  # vocab_size 128, read from the model's embedding
    assert not (tmp_path / "out").exists()


def test_a_broken_jsonl_line_names_file_and_line(tmp_path):
    path = token_file(tmp_path, {"input_ids": [1, 2]}, "", '{"input_ids": [1, 2', {"input_ids": [3]})
    with pytest.raises(ValueError, match=rf"^{path}:3: not valid JSON \(Expecting .* at column \d+\)"):
        read_documents(str(path), None)
    path = token_file(tmp_path, {"text": "a"}, "[1, 2, 3]")
    with pytest.raises(ValueError, match=rf"^{path}:2: a record must be a JSON object, got list"):
        read_documents(str(path), None)
    path = token_file(tmp_path, {"input_ids": [1, 2]}, {"text": "a"})
    with pytest.raises(ValueError, match=rf"^{path}:2: record has no input_ids, while line 1 has"):
        read_documents(str(path), None)
    path = token_file(tmp_path, {"input_ids": 5})
    with pytest.raises(ValueError, match=rf"^{path}:1: input_ids must be a list of token ids"):
        read_documents(str(path), None)
    path.write_bytes('{"text": "caf\u00e9"}\n'.encode("utf-16"))
    with pytest.raises(ValueError, match=rf"^{path}: not UTF-8 text"):
        read_documents(str(path), None)
