"""Padding, batching and packing: each sequence is laid out in blocks from its own real tokens."""

import re

import pytest
import tiny_models
import torch
import torch.nn.functional as F
from kernel_cases import model_tol, rounding_tol

from moba_hf import MobaConfig
from moba_hf.integration import cache as moba_cache
from moba_hf.integration.layout import document_ids, forward_layout, sequence_spans

TINY = {**tiny_models.TINY, "pad_token_id": 0}
MODEL_TOL = model_tol(TINY, 20)  # rows here are at most 20 tokens
LENGTHS = (13, 6, 10)  # blocks of 4: partial last blocks, different pad widths


def tiny_model(moba=None):
    return tiny_models.tiny_model("llama", moba, pad_token_id=0)


def sequences():
    return [torch.randint(1, 97, (n,)) for n in LENGTHS]


def pad_batch(seqs, side):
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        cols = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[row, cols], mask[row, cols] = s, 1
    return ids, mask


# --- layout -------------------------------------------------------------------------------------------------------
def test_document_ids_split_where_positions_restart():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert document_ids(pos).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]


def test_sequence_spans_left_right_and_packed():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    spans = sequence_spans(mask, 2, 5, 5)
    assert [(r, k.tolist()) for r, k in spans] == [(0, [2, 3, 4]), (1, [0, 1, 2])]
    packed = document_ids(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    assert [k.tolist() for _, k in sequence_spans(packed, 1, 6, 6)] == [[0, 1, 2], [3, 4], [5]]
    # position ids alone split nothing: packing is transformers' decision, carried by the layout
    assert sequence_spans(None, 1, 6, 6) is None


def test_forward_layout_reads_transformers_packing_decision():
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        find_packed_sequence_indices,
        packed_sequence_mask_function,
    )

    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 2, 4, 6, 8, 10]])
    packed = and_masks(causal_mask_function, packed_sequence_mask_function(find_packed_sequence_indices(pos)))
    layout = forward_layout(None, packed, 2, 6, 6)
    assert layout.tolist() == document_ids(pos).tolist() == [[0, 0, 0, 1, 1, 2], [0, 1, 2, 3, 4, 5]]
    assert forward_layout(None, causal_mask_function, 2, 6, 6) is None  # transformers did not pack
    assert forward_layout(None, packed, 2, 1, 6, kv_offset=5) is None  # a cached step is never packed
    assert forward_layout(torch.ones(2, 6), packed, 2, 6, 6) is None  # an attention mask: padding only
    assert sequence_spans(None, 3, 1, 9) is None


@pytest.mark.parametrize("case", ["all_real_mask", "one_document_rows", "padded", "packed"])
def test_a_traced_layout_computes_as_the_eager_one(case, monkeypatch, one_thread):
    """Under torch.compile the mask function hands the mask or the document ids on whole, even where they split
    nothing (no branch on tensor values); the attention call then treats them as no layout: the same logits."""
    from moba_hf.integration import layout

    model = tiny_models.tiny_model("llama", MobaConfig(block_size=4, top_k=2))
    ids = torch.randint(0, 97, (2, 20))
    if case in ("all_real_mask", "padded"):
        mask = torch.ones_like(ids)
        if case == "padded":
            mask[0, :7] = 0
        kwargs = {"attention_mask": mask}
    else:  # no mask and no cache: transformers' packing rule reads position_ids
        positions = torch.arange(20).expand(2, -1)
        if case == "packed":
            positions = torch.cat([torch.arange(12), torch.arange(8)]).expand(2, -1)
        kwargs = {"position_ids": positions, "use_cache": False}
    with torch.no_grad():
        want = model(ids, **kwargs).logits
        monkeypatch.setattr(layout, "_traced", lambda: True)
        assert torch.equal(model(ids, **kwargs).logits, want)
    if case in ("all_real_mask", "one_document_rows"):  # handed on whole, then read as no layout: the batched path
        from transformers.masking_utils import causal_mask_function

        traced = layout.forward_layout(kwargs.get("attention_mask"), causal_mask_function, 2, 20, 20)
        assert traced is not None and layout.sequence_spans(traced, 2, 20, 20) is None


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no_cache"])
@pytest.mark.parametrize("width", [10, 15, "one_row"])
def test_attention_mask_of_the_wrong_shape_is_refused(width, use_cache):
    """A mask shorter or longer than the keys, or with one row for a batch of two, would mark the wrong keys as
    padding (a shorter one ran with output 0.29 away from the right mask's); it is refused with its shape named,
    also on a cached step, whose mask covers the cached keys too."""
    model = tiny_model(MobaConfig(block_size=4, top_k=2))
    ids = torch.randint(1, 97, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0
    wrong = mask[:1] if width == "one_row" else F.pad(mask, (0, width - 12), value=1)[:, :width]
    expected = (
        re.escape("attention_mask must have shape (batch, keys) = (2, 12)")
        + ".* got shape "
        + re.escape(str(tuple(wrong.shape)))
    )
    with torch.no_grad(), pytest.raises(ValueError, match=expected):
        model(ids, attention_mask=wrong, use_cache=use_cache)
    if use_cache:  # a cached step: 11 cached keys + 1 new one
        with torch.no_grad():
            past = model(ids[:, :11], attention_mask=mask[:, :11]).past_key_values
            with pytest.raises(ValueError, match="= \\(2, 12\\).* got shape \\(2, 11\\)"):
                model(ids[:, 11:], attention_mask=mask[:, :11], past_key_values=past)
            model(ids[:, 11:], attention_mask=mask, past_key_values=past)  # the right mask runs


# --- batched generation --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("decode", ["moba", "full"])
def test_left_padded_batched_generate_equals_per_sequence(decode, monkeypatch):
    model = tiny_model(MobaConfig(block_size=4, top_k=2, decode=decode))
    decodes = []
    real_decode = moba_cache.core.decode
    monkeypatch.setattr(moba_cache.core, "decode", lambda *a, **k: decodes.append(1) or real_decode(*a, **k))
    seqs = sequences()
    gen = dict(max_new_tokens=9, min_new_tokens=9, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ids, mask = pad_batch(seqs, "left")
    batched = model.generate(ids, attention_mask=mask, **gen)
    assert (len(decodes) > 0) == (decode == "moba")
    for row, s in enumerate(seqs):
        alone = model.generate(s[None], **gen)
        assert torch.equal(batched.sequences[row, -9:], alone.sequences[0, -9:])
        for step_batched, step_alone in zip(batched.scores, alone.scores, strict=True):
            torch.testing.assert_close(step_batched[row], step_alone[0], rtol=MODEL_TOL, atol=MODEL_TOL)


def test_pad_keys_never_reach_the_output():
    model = tiny_model(MobaConfig(block_size=4, top_k=2))
    ids, mask = pad_batch(sequences(), "left")
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        ids[mask == 0] = torch.randint(1, 97, (int((mask == 0).sum()),))  # change what sits under the pads
        got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=0)


# --- packing ------------------------------------------------------------------------------------------------------
def test_packed_rows_equal_separate_sequences():
    use_cache = False  # with a cache transformers does not pack (see test_position_ids_split_where_sdpa_splits)
    model = tiny_model(MobaConfig(block_size=4, top_k=2))
    seqs = sequences()
    # two packed rows, as DataCollatorWithFlattening makes them (no attention_mask)
    rows = [seqs, [seqs[2], seqs[0], seqs[1]]]
    ids = torch.stack([torch.cat(r) for r in rows])
    position_ids = torch.stack([torch.cat([torch.arange(len(s)) for s in r]) for r in rows])
    with torch.no_grad():
        packed = model(ids, position_ids=position_ids, use_cache=use_cache).logits
        for row, r in enumerate(rows):
            start = 0
            for s in r:
                alone = model(s[None]).logits[0]
                torch.testing.assert_close(packed[row, start : start + len(s)], alone, rtol=MODEL_TOL, atol=MODEL_TOL)
                start += len(s)


def _position_ids(kind: str, n: int) -> torch.Tensor:
    half = n // 2
    return {
        "stride": torch.arange(n) * 2,
        "gap": torch.cat([torch.arange(half), torch.arange(half, n) + 7]),
        "packed": torch.cat([torch.arange(half), torch.arange(n - half)]),
        "plain": torch.arange(n),
    }[kind][None]


@pytest.mark.parametrize("forward", ["default", "no_cache", "mask_no_cache", "cached_step"])
@pytest.mark.parametrize("kind", ["stride", "gap", "packed"])
def test_position_ids_split_where_sdpa_splits(kind, forward):
    """top_k >= blocks is causal attention, so "moba" must equal "sdpa" for any position_ids: rows split into
    documents exactly where transformers' masks split them (packed ids without attention_mask and cache)."""
    moba = tiny_model(MobaConfig(block_size=4, top_k=100))
    sdpa = tiny_model()
    sdpa.load_state_dict(moba.state_dict())
    sdpa.eval()
    n = 20
    ids = torch.randint(1, 97, (2, n))
    pos = _position_ids(kind, n).expand(2, n)
    kw = {"position_ids": pos}
    if forward in ("no_cache", "mask_no_cache"):
        kw["use_cache"] = False
    if forward == "mask_no_cache":
        kw["attention_mask"] = torch.ones(2, n, dtype=torch.long)
    with torch.no_grad():
        if forward == "cached_step":  # prefill with these ids, then 3 more tokens through the cache
            outs = []
            for model in (moba, sdpa):
                first = model(ids[:, :-3], position_ids=pos[:, :-3])
                outs.append(model(ids[:, -3:], position_ids=pos[:, -3:], past_key_values=first.past_key_values).logits)
            got, want = outs
        else:
            got, want = moba(ids, **kw).logits, sdpa(ids, **kw).logits
    # float64 end to end: the two paths differ only in summation order
    torch.testing.assert_close(got, want, rtol=MODEL_TOL, atol=MODEL_TOL)


# --- right padding in training ----------------------------------------------------------------------------------------
def test_right_padded_training_batch_loss_and_grads_equal_per_sequence():
    model = tiny_model(MobaConfig(block_size=4, top_k=2)).train()
    seqs = sequences()
    ids, mask = pad_batch(seqs, "right")
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    # transformers computes the loss in float32; the gradient check below stays in float64
    shifted = labels[:, 1:]
    loss = F.cross_entropy(out.logits[:, :-1][shifted != -100], shifted[shifted != -100])
    tol = rounding_tol(torch.float32, TINY["vocab_size"], int(mask.sum()))  # float32 log-softmax and token mean
    torch.testing.assert_close(out.loss, loss.float(), rtol=tol, atol=tol)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # the same loss from separate forwards: the mean over every predicted real token of the batch
    token_losses = []
    for s in seqs:
        logits = model(s[None]).logits[0, :-1]
        token_losses.append(F.cross_entropy(logits, s[1:], reduction="none"))
    want = torch.cat(token_losses).mean()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=MODEL_TOL, atol=MODEL_TOL)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=MODEL_TOL, atol=MODEL_TOL, msg=name)
