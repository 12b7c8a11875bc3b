"""The adaptive block budget (top_p): each query keeps the fewest best blocks covering a share of the gate's softmax,
between min_top_k and top_k; the same selection in every kernel, in decode, under DCA, and counted as measured."""

import pytest
import torch
from kernel_cases import CASES, assert_propagates_like_reference, call, rounding_tol
from tiny_models import tiny_model

import moba_hf
from moba_hf import MobaConfig
from moba_hf.integration import sparsity
from moba_hf.kernels import GateOptions, moba_attention_reference, selected_blocks
from moba_hf.kernels.decode import block_keys_from_cache, moba_decode
from moba_hf.kernels.torch_impl import moba_attention_torch


def _qk(b=2, hq=4, hkv=2, n=120, d=16, peak=2.0):
    return torch.randn(b, hq, n, d, dtype=torch.float64) * peak, torch.randn(b, hkv, n, d, dtype=torch.float64)


def _counts(q, k, block_size, top_k, **gate):
    return selected_blocks(q, k, block_size=block_size, top_k=top_k, gate=GateOptions(**gate)).sum(-1)


def test_counts_lie_between_min_top_k_and_top_k_and_fall_with_top_p():
    q, k = _qk()
    fixed = _counts(q, k, 8, 8)
    low, high = _counts(q, k, 8, 8, top_p=0.3, min_top_k=2), _counts(q, k, 8, 8, top_p=0.9, min_top_k=2)
    available = torch.arange(120) // 8 + 1  # blocks up to and including each query's own
    assert (low >= torch.clamp(available, max=2)).all() and (high <= fixed).all() and (low <= high).all()
    assert low.float().mean() < high.float().mean() < fixed.float().mean()  # the budget really adapts


def test_top_p_one_is_the_fixed_budget_and_min_top_k_equal_top_k_too():
    q, k = _qk()
    fixed = selected_blocks(q, k, block_size=8, top_k=5)
    for gate in (GateOptions(top_p=1.0), GateOptions(top_p=0.01, min_top_k=5)):
        assert torch.equal(selected_blocks(q, k, block_size=8, top_k=5, gate=gate), fixed)


def test_the_picks_are_the_fewest_that_cover_top_p():
    """Without the last pick a query covers less than top_p (else the pick was not needed); with it, at least top_p
    unless top_k stopped it."""
    q, k = _qk(b=1, hq=2, hkv=1, n=64, d=8)
    sel = selected_blocks(q, k, block_size=8, top_k=8, gate=GateOptions(top_p=0.7))
    scores = torch.einsum("hqd,hnd->hqn", q[0], k[0].view(1, 8, 8, 8).mean(2).expand(2, 8, 8)) / 8**0.5
    for h in range(2):
        for i in range(64):
            own = i // 8
            if own == 0:
                continue
            share = torch.softmax(scores[h, i, :own], 0)  # the earlier blocks' mass (the own block is not in it)
            picks = sel[0, h, i, :own]
            covered = float(share[picks].sum())
            if picks.any():
                weakest = share.masked_fill(~picks, 2).min()
                assert covered - float(weakest) < 0.7
            assert covered >= 0.7 - 1e-12 or bool(picks.all())


@pytest.mark.parametrize("which,value", [("k", float("nan")), ("q", float("nan")), ("k", float("inf"))])
def test_nan_and_inf_propagate_as_in_the_reference(which, value):
    assert_propagates_like_reference(
        moba_attention_torch, CASES["odd"], which, value, top_p=0.5, pooling="mean", sink_blocks=1
    )


def test_sparse_decode_selects_and_attends_as_the_reference():
    q = torch.randn(3, 6, 2, 8, dtype=torch.float64) * 3
    keys = torch.randn(3, 2, 90, 8, dtype=torch.float64)
    values = torch.randn_like(keys)
    starts = torch.tensor([0, 4, 9])
    gate = dict(block_size=6, top_k=6, pooling="bound", sink_blocks=1, top_p=0.6, min_top_k=2)
    out = moba_decode(q, keys, values, block_keys_from_cache(keys, 6, "bound", starts), starts=starts, **gate)
    for r, s in enumerate(starts.tolist()):
        want = call(moba_attention_reference, q[r : r + 1], keys[r : r + 1, :, s:], values[r : r + 1, :, s:], **gate)
        tol = rounding_tol(torch.float64, 2, 90, 8)
        torch.testing.assert_close(out[r : r + 1], want, rtol=tol, atol=tol)


def test_tracked_sparsity_is_counted_on_the_real_selection():
    """With top_p the rule alone cannot count the pairs: the tracker counts the selection, which skips more than
    the fixed budget of the same top_k."""
    model = tiny_model("llama", layers=2)
    ids = torch.randint(0, 97, (2, 120))
    measured = {}
    for name, moba in {
        "fixed": MobaConfig(block_size=8, top_k=6),
        "top-p": MobaConfig(block_size=8, top_k=6, top_p=0.5, dense_tail=7),
    }.items():
        moba_hf.apply(model, moba)
        with torch.no_grad(), moba_hf.track_sparsity() as stats:
            model(ids)
        measured[name] = stats.overall
        moba_hf.revert(model)
    assert measured["fixed"] == pytest.approx(MobaConfig(block_size=8, top_k=6).theoretical_sparsity(120))
    assert measured["top-p"] > measured["fixed"]


def test_selected_pairs_counts_a_dense_tail_as_causal():
    q, k = _qk(b=1, hq=2, hkv=1, n=40, d=8)
    selected = selected_blocks(q, k, block_size=8, top_k=2)
    tail = 5
    want = sparsity.attended_pairs(selected[:, :, :-tail], 35, 8) + 2 * sum(p + 1 for p in range(35, 40))
    assert sparsity.selected_pairs(selected, 40, 8, tail) == want
    assert sparsity.selected_pairs(selected, 40, 8) == sparsity.attended_pairs(selected, 40, 8)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"top_p": 0}, r"top_p must be None .* in \(0, 1\], got 0"),
        ({"top_p": 1.5}, r"top_p must be .* got 1.5"),
        ({"top_p": float("nan")}, r"top_p must be .* got nan"),
        ({"top_p": True}, r"top_p must be .* got True"),
        ({"top_p": "0.5"}, r"top_p must be .* got '0.5'"),
        ({"min_top_k": 0}, r"min_top_k must be an integer >= 1, got 0"),
        ({"top_k": 3, "top_p": 0.5, "min_top_k": 4}, r"min_top_k must be between 1 and top_k \(3\), got 4"),
        (
            {"top_k": 3, "top_p": 0.5, "decode_top_k": 2, "min_top_k": 3},
            r"min_top_k must be between 1 and decode_top_k \(2\)",
        ),
        ({"top_k": 3, "decode_top_k": 0}, r"decode_top_k must be an integer >= 1, got 0"),
        ({"min_top_k": 2}, r"min_top_k applies only with top_p .* got min_top_k=2 and top_p=None"),
        ({"top_k": 3, "decode_top_k": 8, "decode": "full"}, r"decode_top_k .* needs decode='moba', .*decode='full'"),
    ],
)
def test_bad_values_are_refused_naming_the_field_and_range(fields, message):
    with pytest.raises(ValueError, match=message):
        MobaConfig(**fields)
    if "top_k" not in fields:  # the kernels' keywords refuse the same values
        q, k = _qk(b=1, n=16)
        with pytest.raises(ValueError, match=message.split(" ")[0]):
            call(moba_attention_reference, q, k, k, block_size=4, top_k=3, **fields)


@pytest.mark.parametrize("top_k,top_p,dense_tail", [(2, 0.5, 0), (1, 0.5, 0), (2, 1.0, 0), (2, 0.5, 16)])
def test_the_kernels_refuse_min_top_k_above_top_k(top_k, top_p, dense_tail):
    """Also where nothing is gated (top_k = 1), the budget is the fixed one (top_p = 1) or the dense tail covers
    every query (the gate never runs)."""
    from moba_hf.kernels import moba_attention

    q, k = _qk(b=1, n=16)
    with pytest.raises(ValueError, match=rf"min_top_k must be between 1 and top_k \({top_k}\), got 3"):
        moba_attention(q, k, k, block_size=4, top_k=top_k, top_p=top_p, min_top_k=3, dense_tail=dense_tail)


def test_a_config_file_carries_the_budget(tmp_path):
    path = tmp_path / "adaptive.toml"
    path.write_text("[moba]\nblock_size = 64\ntop_k = 12\ntop_p = 0.9\nmin_top_k = 3\n")
    config = MobaConfig.from_file(path)
    assert (config.top_p, config.min_top_k) == (0.9, 3)
    assert config.plan(2).gate == config.plan(1).gate == GateOptions(top_p=0.9, min_top_k=3)
    assert MobaConfig.from_dict(config.to_dict()) == config
