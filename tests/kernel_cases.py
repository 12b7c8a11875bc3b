"""Helpers shared by the kernel test files: case ids, random q/k/v for a case, forward plus gradients."""

from __future__ import annotations

import torch

# (B, Hq, Hkv, Nq, Nk, D, block_size, top_k): the cases each backend is compared with the reference on
CASES = {
    "odd": (2, 4, 2, 63, 63, 16, 16, 3),  # odd length, GQA, batch > 1, partial last block
    "d60": (1, 8, 2, 111, 111, 60, 16, 3),  # T=111, D=60
    "chunk": (1, 4, 1, 40, 111, 16, 20, 2),  # chunked prefill Nq < Nk (after cached keys), MQA, first block cut
    "decode": (2, 2, 2, 1, 50, 8, 16, 3),  # decode Nq = 1
    "own-block": (2, 6, 3, 30, 77, 12, 10, 1),  # top_k = 1: own block only
    "causal": (1, 3, 3, 50, 50, 8, 7, 100),  # top_k >= blocks: plain causal
    "one-block": (1, 2, 1, 33, 33, 8, 64, 3),  # block_size >= Nk
    "many-blocks": (1, 2, 1, 300, 300, 8, 8, 4),  # many blocks
}
SHAPES = list(CASES.values())


def shape_id(shape) -> str:
    """(B, Hq, Hkv, Nq, Nk, D, block_size, top_k) -> e.g. B2-T63-Q63-H2-HQ4-D16-blk16-k3."""
    b, hq, hkv, nq, nk, d, bs, k = shape
    return f"B{b}-T{nk}-Q{nq}-H{hkv}-HQ{hq}-D{d}-blk{bs}-k{k}"


def gate_id(gate: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in gate.items()) or "mean"


def moba_inputs(shape, dtype=torch.float64, device="cpu", requires_grad=True) -> list[torch.Tensor]:
    b, hq, hkv, nq, nk, d, _, _ = shape
    q = torch.randn(b, hq, nq, d, dtype=dtype, device=device)
    k = torch.randn(b, hkv, nk, d, dtype=dtype, device=device)
    v = torch.randn(b, hkv, nk, d, dtype=dtype, device=device)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def call(fn, q, k, v, *, scale=None, **kw):
    """The backend `fn(q, k, v, plan, scale)` under `moba_attention`'s keywords (block_size, top_k, the gate's)."""
    from moba_hf.kernels import BlockPlan

    return fn(q, k, v, BlockPlan.build(**kw), scale)


def call_dca(q, k, v, *, block_size=None, top_k=3, dense_tail=0, pooling="mean", **kw):
    """`dca_attention` with MoBA's keywords as `moba_attention` takes them (block_size None: dense DCA); the other
    keywords (pretraining_length, chunk_size, inv_freq, scale, temperature, the gate's) go where they belong."""
    from moba_hf.kernels import BlockPlan
    from moba_hf.kernels.dual_chunk import dca_attention

    gate = {name: kw.pop(name) for name in ("sink_blocks", "local_blocks", "top_p", "min_top_k") if name in kw}
    plan = None if block_size is None else BlockPlan.build(block_size, top_k, pooling, dense_tail=dense_tail, **gate)
    return dca_attention(q, k, v, plan=plan, **kw)


def fwd_bwd(fn, q, k, v, grad, **kw):
    """The backend fn's output (keywords as in `call`) and its q/k/v gradients for the output gradient `grad`."""
    out = call(fn, q, k, v, **kw)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def rounding_tol(dtype: torch.dtype, *sizes: int) -> float:
    """Tolerance for two computations of one result in `dtype` that differ only in rounding order (O(1) inputs).

    An n-term sum is within n * eps of the exact value in the worst case (recursive summation), so two orders
    differ by at most 2 * n * eps; n is the reduction lengths the result passes through (keys, queries for dk / dv,
    head_dim for the scores). Measured errors of the CPU backends stay below n * eps / 5 on the shapes here.
    """
    return 2 * sum(sizes) * torch.finfo(dtype).eps


def case_tol(shape, dtype: torch.dtype) -> float:
    """`rounding_tol` of a (B, Hq, Hkv, Nq, Nk, D, block_size, top_k) case."""
    return rounding_tol(dtype, shape[3], shape[4], shape[5])


def flash_atol(expected: torch.Tensor) -> float:
    """flash-attention's slack for its "2x a same-dtype PyTorch computation" rule (`fwd_atol` in its tests): twice
    the rounding of the reference's own dtype at the output's scale, so a near-exact baseline stays passable."""
    expected = expected.detach()
    return 2 * float((expected + 0.3 - 0.3 - expected).abs().max())


def poisoned_inputs(shape, which: str, index: int, value: float = float("nan"), dtype=torch.float64, device="cpu"):
    """moba_inputs with one entry set to `value`: batch 0, head 0, position `index` (a query row for "q", a key
    position for "k" / "v"), dim 0."""
    q, k, v = moba_inputs(shape, dtype, device, requires_grad=False)
    {"q": q, "k": k, "v": v}[which][0, 0, index, 0] = value
    return [t.requires_grad_() for t in (q, k, v)]


def selection(q, k, **kw) -> torch.Tensor:
    """The shared selection under `moba_attention`'s keywords (block_size, top_k, pooling, sink_blocks, ...)."""
    from moba_hf.kernels import BlockPlan, selected_blocks

    plan = BlockPlan.build(**kw)
    return selected_blocks(q, k, block_size=plan.block_size, top_k=plan.top_k, gate=plan.gate)


def rows_that_see(q, k, which: str, index: int, **kw) -> torch.Tensor:
    """bool [B, Hq, Nq]: the rows whose result depends on entry (0, 0, index) of q, k or v under the shared
    selection: the query row itself, or the rows attending key `index` (the query heads of kv head 0)."""
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    rows = torch.zeros(b, hq, nq, dtype=torch.bool)
    if which == "q":
        rows[0, 0, index] = True
        return rows
    selected = selection(q.detach(), k.detach(), **kw).cpu()
    attends = selected[..., index // kw["block_size"]] & (torch.arange(nk - nq, nk) >= index)
    group = hq // hkv
    rows[0, :group] = attends[0, :group]
    return rows


def assert_propagates_like_reference(fn, shape, which: str, value: float, device="cpu", **gate):
    """fn's output has the reference's NaN / inf pattern and its finite values; finite rows keep finite gradients."""
    from moba_hf.kernels import moba_attention_reference

    nq, nk = shape[3], shape[4]
    index = nq // 2 if which == "q" else nk - nq + nq // 2  # a key some queries see and some do not
    q, k, v = poisoned_inputs(shape, which, index, value, device=device)
    kw = {"block_size": shape[6], "top_k": shape[7], **gate}
    with torch.no_grad():
        expected = call(moba_attention_reference, q, k, v, **kw)
    out = call(fn, q, k, v, **kw)
    assert torch.equal(out.isnan(), expected.isnan()), (~out.isfinite()).any(-1).nonzero().tolist()
    assert torch.equal(out.isinf(), expected.isinf())
    finite = expected.isfinite()
    tol = case_tol(shape, torch.float64)
    torch.testing.assert_close(out[finite], expected[finite], atol=tol, rtol=tol)
    (dq,) = torch.autograd.grad(out, (q,), torch.randn_like(out))
    assert dq[finite.all(dim=-1)].isfinite().all()


def model_tol(config: dict, seq_len: int) -> float:
    """`rounding_tol` for float64 logits / gradients of a tiny model computed two ways (batched vs alone, cached vs
    full, sparse vs dense): each layer's reductions (tokens, hidden, MLP, vocab) once per layer."""
    sizes = (seq_len, config["hidden_size"], config["intermediate_size"], config["vocab_size"])
    return config["num_hidden_layers"] * rounding_tol(torch.float64, *sizes)
