"""Training data: packing layout, readers, the synthetic retrieval generator, and no attention across documents."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import moba_hf
from moba_hf.eval.passkey import QUESTION, build_prompt, passkey_line
from moba_hf.integration.layout import sequence_spans
from moba_hf.train import Document, collate, pack, read_documents
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
    spans = sequence_spans(None, batch["position_ids"], 3, 4, 4)
    assert [(row, keys.tolist()) for row, keys in spans] == [
        (0, [0, 1, 2]),
        (0, [3]),
        (1, [0, 1, 2, 3]),
        (2, [0]),
        (2, [1, 2, 3]),
    ]


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


TINY = {
    "llama": (LlamaForCausalLM, LlamaConfig),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config),
}


@pytest.mark.parametrize("attn", ["moba", "sdpa"])
@pytest.mark.parametrize("arch", sorted(TINY))
def test_packed_row_never_attends_across_documents(arch, attn):
    """Probe: in a packed row [A | B | C], changing A's tokens leaves B's and C's logits unchanged, and B's
    logits equal those of B run alone. Blocks (8) straddle the document boundaries (13, 30)."""
    model_cls, config_cls = TINY[arch]
    config = config_cls(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    model = model_cls(config).eval()
    if attn == "moba":
        moba_hf.apply(model, moba_hf.MobaConfig(block_size=8, top_k=2))
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
    torch.testing.assert_close(logits_changed[13:], logits[13:], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[13:30], alone_b, rtol=1e-4, atol=1e-5)
