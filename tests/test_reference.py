"""The reference MoBA against an independent brute-force implementation and degenerate oracles."""

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import call, rounding_tol

from moba_hf.kernels import causal_attention, gate_scores, moba_attention, moba_attention_reference


def brute_force_moba(
    q, k, v, block_size, top_k, scale=None, pooling="mean", sink_blocks=0, local_blocks=0, top_p=None, min_top_k=1
):
    """Loops over every (batch, head, query): the kernel contract written as plainly as possible."""
    q, k, v = q.double(), k.double(), v.double()
    b_, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    out = torch.zeros_like(q)
    n_blocks = math.ceil(nk / block_size)
    for b in range(b_):
        for h in range(hq):
            kh, vh = k[b, h // (hq // hkv)], v[b, h // (hq // hkv)]
            blocks = [kh[j * block_size : min((j + 1) * block_size, nk)] for j in range(n_blocks)]
            for i in range(nq):
                p = nk - nq + i
                c = p // block_size

                def gate(j, qi=q[b, h, i], blocks=blocks):
                    if pooling == "bound":  # the largest q.k any key of the block could reach, channel by channel
                        lo, hi = blocks[j].min(0).values, blocks[j].max(0).values
                        return float(torch.maximum(qi * lo, qi * hi).sum())
                    mean, top = float(qi @ blocks[j].mean(0)), float(qi @ blocks[j].max(0).values)
                    return {"mean": mean, "max": top, "mean+max": mean + top}[pooling]

                forced = {j for j in range(c) if j < sink_blocks or j >= c - local_blocks}
                rest = sorted((j for j in range(c) if j not in forced), key=gate, reverse=True)
                picks = rest[: top_k - 1]
                if top_p is not None and top_p < 1:  # the fewest best blocks covering top_p of the gate's softmax
                    earlier = [*forced, *rest]  # the own block is not in the mass: its keys reach past the query
                    scores = torch.tensor([gate(j) for j in earlier]) / d**0.5
                    share = dict(zip(earlier, torch.softmax(scores, 0), strict=True))
                    covered, picks = sum(float(share[j]) for j in forced), []
                    for j in rest[: top_k - 1]:
                        if len(picks) >= min_top_k - 1 and covered >= top_p:
                            break
                        picks.append(j)
                        covered += float(share[j])
                chosen = sorted(forced) + picks
                keys = list(range(c * block_size, p + 1))
                for j in chosen:
                    keys += range(j * block_size, (j + 1) * block_size)
                keys = sorted(keys)
                w = torch.softmax((kh[keys] @ q[b, h, i]) * scale, dim=0)
                out[b, h, i] = w @ vh[keys]
    return out


CASES = [
    # B, Hq, Hkv, Nq, Nk, D, block, top_k
    (1, 2, 2, 17, 17, 8, 4, 2),
    (2, 4, 2, 23, 23, 6, 5, 3),  # GQA, batch > 1, odd length
    (2, 6, 2, 9, 31, 4, 4, 2),  # Nq < Nk (chunked prefill)
    (1, 3, 1, 1, 29, 8, 4, 3),  # decode, MQA
    (2, 4, 4, 19, 19, 8, 3, 1),  # top_k = 1: own block only
    (1, 4, 2, 21, 21, 8, 4, 9),  # top_k >= blocks
    (1, 2, 1, 13, 13, 8, 16, 2),  # block_size >= Nk
    (2, 2, 1, 7, 40, 5, 6, 4),  # partial last block, Nq < Nk
]


def case_id(c):
    return "B{}-HQ{}-H{}-Nq{}-Nk{}-D{}-blk{}-k{}".format(*c)


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_reference_matches_brute_force(case):
    b, hq, hkv, nq, nk, d, bs, top_k = case
    q = torch.randn(b, hq, nq, d, dtype=torch.float64)
    k = torch.randn(b, hkv, nk, d, dtype=torch.float64)
    v = torch.randn(b, hkv, nk, d, dtype=torch.float64)
    got = call(moba_attention_reference, q, k, v, block_size=bs, top_k=top_k)
    tol = rounding_tol(torch.float64, nq, nk, d)
    torch.testing.assert_close(got, brute_force_moba(q, k, v, bs, top_k), rtol=tol, atol=tol)


GATE_CASES = [
    ("max", 0, 0),
    ("mean+max", 0, 0),
    ("mean", 1, 0),
    ("mean", 0, 1),
    ("max", 2, 1),
    ("bound", 0, 0),
    ("bound", 1, 1),
]


@pytest.mark.parametrize("pooling,sink,local", GATE_CASES, ids=[f"{p}-sink{s}-local{l}" for p, s, l in GATE_CASES])
def test_gate_options_match_brute_force(pooling, sink, local):
    q = torch.randn(2, 4, 37, 6, dtype=torch.float64)
    k = torch.randn(2, 2, 37, 6, dtype=torch.float64)
    v = torch.randn(2, 2, 37, 6, dtype=torch.float64)
    opts = dict(pooling=pooling, sink_blocks=sink, local_blocks=local)
    got = call(moba_attention_reference, q, k, v, block_size=4, top_k=3, **opts)
    tol = rounding_tol(torch.float64, 37, 37, 6)
    torch.testing.assert_close(got, brute_force_moba(q, k, v, 4, 3, **opts), rtol=tol, atol=tol)


TOP_P_CASES = [  # top_p, min_top_k, gate keywords, query scale (larger: a peakier gate, fewer blocks)
    (0.5, 1, {}, 1.0),
    (0.9, 1, {"pooling": "bound", "sink_blocks": 1, "local_blocks": 1}, 3.0),
    (0.2, 3, {"pooling": "max"}, 1.0),  # the minimum binds
    (0.7, 1, {"pooling": "mean+max", "local_blocks": 1}, 5.0),
]


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
@pytest.mark.parametrize(
    "top_p,min_top_k,gate,peak", TOP_P_CASES, ids=lambda x: str(x) if not isinstance(x, dict) else ""
)
def test_adaptive_budget_matches_brute_force(case, top_p, min_top_k, gate, peak):
    b, hq, hkv, nq, nk, d, bs, top_k = case
    min_top_k = min(min_top_k, top_k)
    q = torch.randn(b, hq, nq, d, dtype=torch.float64) * peak
    k = torch.randn(b, hkv, nk, d, dtype=torch.float64)
    v = torch.randn(b, hkv, nk, d, dtype=torch.float64)
    opts = dict(top_p=top_p, min_top_k=min_top_k, **gate)
    got = call(moba_attention_reference, q, k, v, block_size=bs, top_k=top_k, **opts)
    tol = rounding_tol(torch.float64, nq, nk, d) * peak
    torch.testing.assert_close(got, brute_force_moba(q, k, v, bs, top_k, **opts), rtol=tol, atol=tol)


def test_custom_scale_and_float32_dtype():
    q, k, v = (torch.randn(1, 2, 20, 8) for _ in range(3))
    got = call(moba_attention_reference, q, k, v, block_size=4, top_k=2, scale=0.3)
    assert got.dtype == torch.float32
    want = brute_force_moba(q, k, v, 4, 2, scale=0.3).float()
    tol = rounding_tol(torch.float32, 20, 20, 8)  # float32 reference vs the float64 brute force, rounded
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("nq,nk,bs", [(33, 33, 4), (5, 33, 4), (1, 33, 8), (20, 20, 64)])
def test_all_blocks_selected_equals_causal_sdpa(nq, nk, bs):
    q = torch.randn(2, 4, nq, 16, dtype=torch.float64)
    k = torch.randn(2, 2, nk, 16, dtype=torch.float64)
    v = torch.randn(2, 2, nk, 16, dtype=torch.float64)
    got = moba_attention(q, k, v, block_size=bs, top_k=math.ceil(nk / bs), backend="reference")
    want = causal_attention(q, k, v)
    tol = rounding_tol(torch.float64, nq, nk, 16)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    if nq == nk:
        k_rep, v_rep = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True))


def test_top_k_one_is_block_diagonal_causal():
    q, k, v = (torch.randn(1, 2, 24, 8, dtype=torch.float64) for _ in range(3))
    got = call(moba_attention_reference, q, k, v, block_size=8, top_k=1)
    for j in range(3):
        s = slice(8 * j, 8 * (j + 1))
        torch.testing.assert_close(got[:, :, s], causal_attention(q[:, :, s], k[:, :, s], v[:, :, s]))


def test_never_attends_future_blocks():
    # values of later keys are huge: any leak into an earlier query's output shows up
    q, k = torch.randn(1, 2, 32, 8, dtype=torch.float64), torch.randn(1, 2, 32, 8, dtype=torch.float64)
    v = torch.zeros(1, 2, 32, 8, dtype=torch.float64)
    v[:, :, 20:] = 1e6
    out = call(moba_attention_reference, q, k, v, block_size=4, top_k=8)
    assert out[:, :, :20].abs().max() < 1e3


def test_gradients_flow_to_q_k_v():
    q, k, v = (torch.randn(1, 4, 19, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    torch.autograd.gradcheck(
        lambda q, k, v: call(moba_attention_reference, q, k, v, block_size=4, top_k=2), (q, k, v)
    )  # gradcheck's float64 defaults (central differences of step 1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"block_size": 0, "top_k": 2}, "block_size must be an integer >= 1, got 0"),
        ({"block_size": 4, "top_k": 0}, "top_k must be an integer >= 1, got 0"),
        ({"block_size": 4.0, "top_k": 2}, "block_size"),
        ({"block_size": 4, "top_k": 2, "pooling": "min"}, "pooling must be one of"),
        ({"block_size": 4, "top_k": 2, "sink_blocks": -1}, "sink_blocks must be an integer >= 0"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    with pytest.raises(ValueError, match=match):
        moba_attention(q, k, v, **kwargs)


def test_bad_shapes_raise_value_error():
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        moba_attention(torch.randn(1, 3, 4, 4), torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4), block_size=2, top_k=1)
    with pytest.raises(ValueError, match="Nq <= Nk"):
        moba_attention(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4), block_size=2, top_k=1)
    with pytest.raises(ValueError, match="backend must be one of"):
        moba_attention(*(torch.randn(1, 2, 4, 4) for _ in range(3)), block_size=2, top_k=1, backend="cuda-magic")


@pytest.mark.parametrize("grad", [False, True], ids=["selection", "differentiable"])
def test_bound_gate_scores(grad):
    """The bound gate's score is sum_d max(q_d min_d, q_d max_d) over the block's keys, whether the queries are
    scored for selection (one buffer, no autograd) or differentiated through (public `gate_scores`)."""
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64, requires_grad=grad)
    k = torch.randn(2, 2, 20, 8, dtype=torch.float64)
    scores = gate_scores(q, k, 4, "bound")
    blocks = k.unflatten(2, (5, 4))
    lo, hi = blocks.amin(3)[:, :, None, None], blocks.amax(3)[:, :, None, None]  # [B, Hkv, 1, 1, 5, D]
    qe = q.unflatten(1, (2, 2))[..., None, :]  # [B, Hkv, G, Nq, 1, D]
    expected = torch.maximum(qe * lo, qe * hi).sum(-1).flatten(1, 2)
    torch.testing.assert_close(scores, expected)
    assert scores.requires_grad == grad
    if grad:
        weights = torch.randn(scores.shape, dtype=torch.float64)
        (actual,) = torch.autograd.grad((scores * weights).sum(), q)
        (wanted,) = torch.autograd.grad((expected * weights).sum(), q)
        torch.testing.assert_close(actual, wanted)
