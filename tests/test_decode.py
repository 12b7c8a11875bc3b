"""Sparse decode over the KV cache: the kernel, the running block state, cached decoding == one full forward."""

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import call, model_tol, rounding_tol
from tiny_models import ARCHS, TINY, tiny_model
from transformers import (
    AttentionInterface,
    DynamicCache,
    LlamaForCausalLM,
)
from transformers.masking_utils import AttentionMaskInterface

import moba_hf
from moba_hf import MobaConfig
from moba_hf.integration import cache as moba_cache
from moba_hf.integration import state as moba_state
from moba_hf.integration.register import moba_mask
from moba_hf.kernels import attend_plan, causal_attention, moba_attention_reference
from moba_hf.kernels.decode import block_keys_from_cache, moba_decode

# --- the kernel ---------------------------------------------------------------------------------------------------
# (B, Hq, Hkv, Nk, Nq, D, block, top_k, pooling, sink, local)
KERNEL_CASES = [
    (2, 4, 2, 37, 1, 8, 5, 3, "mean", 0, 0),
    (1, 6, 2, 64, 3, 16, 8, 2, "max", 1, 0),
    (3, 4, 1, 50, 2, 8, 7, 4, "mean+max", 0, 1),
    (2, 2, 2, 9, 1, 4, 16, 3, "mean", 0, 0),  # block >= sequence: dense
    (2, 4, 2, 40, 4, 8, 4, 1, "mean", 0, 0),  # own block only
    (1, 8, 8, 111, 1, 60, 16, 9, "mean", 0, 0),  # top_k >= blocks
    (3, 4, 2, 63, 5, 8, 6, 2, "mean", 2, 1),
    (2, 6, 3, 45, 2, 8, 5, 3, "bound", 1, 1),
    (3, 9, 3, 203, 1, 12, 16, 5, "bound", 1, 1),  # the training-free gate, SmolLM2's GQA ratio
    (2, 4, 2, 129, 1, 8, 32, 1, "mean", 0, 0),  # top_k = 1, a last block of one key
    (2, 12, 4, 77, 8, 8, 8, 3, "mean", 0, 0),  # DECODE_MAX_QUERIES queries crossing a block boundary
]
# `_attend_in_place` (CPU float32 / float64), `_attend_windows` (the rest) and `_one_query` (CPU float32 / float64,
# one query, rows that start together: a step of `generate`)
PATHS = ["in_place", "windows"]


def _case_id(c):
    b, hq, hkv, nk, nq, d, bs, k, pool, sink, local = c
    return f"B{b}-T{nk}-Q{nq}-H{hkv}-HQ{hq}-D{d}-blk{bs}-k{k}-{pool}-s{sink}l{local}"


def force_path(monkeypatch, path: str) -> list[str]:
    """Make moba_decode take `path`; returns the list the paths taken are appended to."""
    from moba_hf.kernels import decode as decode_kernels

    taken = []
    monkeypatch.setattr(decode_kernels, "_reads_in_place", lambda q, cache: path in ("in_place", "one_query"))
    if path != "one_query":  # rows never "start together": the general paths
        monkeypatch.setattr(decode_kernels, "_common_start", lambda starts: None)
    for name in ("_attend_in_place", "_attend_windows", "_one_query"):
        real = getattr(decode_kernels, name)
        spy = lambda *a, _real=real, _name=name: taken.append(_name) or _real(*a)  # noqa: E731
        monkeypatch.setattr(decode_kernels, name, spy)
    return taken


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=_case_id)
def test_decode_kernel_matches_reference_per_row(case, path, monkeypatch):
    b, hq, hkv, nk, nq, d, bs, k, pool, sink, local = case
    taken = force_path(monkeypatch, path)
    q = torch.randn(b, hq, nq, d, dtype=torch.float64)
    keys = torch.randn(b, hkv, nk, d, dtype=torch.float64)
    values = torch.randn_like(keys)
    starts = torch.tensor([0, 3, 7][:b])  # left padding of different widths
    gate = dict(block_size=bs, top_k=k, pooling=pool, sink_blocks=sink, local_blocks=local)
    out = moba_decode(q, keys, values, block_keys_from_cache(keys, bs, pool, starts), starts=starts, **gate)
    assert taken == [f"_attend_{path}"]
    for r in range(b):
        s = int(starts[r])
        want = call(moba_attention_reference, q[r : r + 1], keys[r : r + 1, :, s:], values[r : r + 1, :, s:], **gate)
        tol = rounding_tol(torch.float64, nq, nk, d)
        torch.testing.assert_close(out[r : r + 1], want, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=_case_id)
def test_rows_of_one_length_select_as_padded_rows_do_step_after_step(case):
    """starts=None (rows of one length) keeps each step's block masks for the next steps: over a growing cache,
    with the masks of earlier steps kept, every step selects what the same rows passed with starts select, and
    attends as the reference does."""
    b, hq, hkv, nk, nq, d, bs, k, pool, sink, local = case
    q = torch.randn(b, hq, nq, d, dtype=torch.float64)
    keys = torch.randn(b, hkv, nk + 2 * bs, d, dtype=torch.float64)
    values = torch.randn_like(keys)
    gate = dict(block_size=bs, top_k=k, pooling=pool, sink_blocks=sink, local_blocks=local)
    for n in range(max(nq, nk - bs), nk + 2 * bs + 1):  # every position inside a block, and across two boundaries
        kc, vc = keys[:, :, :n], values[:, :, :n]
        block_keys = block_keys_from_cache(kc, bs, pool)
        out, chosen = moba_decode(q, kc, vc, block_keys, return_selection=True, **gate)
        zeros = torch.zeros(b, dtype=torch.long)
        _, want_chosen = moba_decode(q, kc, vc, block_keys, starts=zeros, return_selection=True, **gate)
        assert torch.equal(chosen, want_chosen), n
        want = call(moba_attention_reference, q, kc, vc, **gate)
        tol = rounding_tol(torch.float64, nq, n, d)
        torch.testing.assert_close(out, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("case", KERNEL_CASES[:3] + KERNEL_CASES[5:9], ids=_case_id)
def test_decode_gradients_equal_the_reference(case, contiguous):
    """Under autograd the step gathers its windows as tracked copies: dq, dk, dv equal the reference's."""
    b, hq, hkv, nk, nq, d, bs, k, pool, sink, local = case
    gate = dict(block_size=bs, top_k=k, pooling=pool, sink_blocks=sink, local_blocks=local)
    q = torch.randn(b, hq, nq, d, dtype=torch.float64, requires_grad=True)
    keys = torch.randn(b, hkv, nk, d, dtype=torch.float64)
    values = torch.randn_like(keys)
    if not contiguous:  # a cache whose rows are strided (heads interleaved)
        keys, values = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (keys, values))
    keys.requires_grad_(True)
    values.requires_grad_(True)
    grad = torch.randn(b, hq, nq, d, dtype=torch.float64)
    got = torch.autograd.grad(moba_decode(q, keys, values, block_keys_from_cache(keys.detach(), bs, pool), **gate),
                              (q, keys, values), grad)  # fmt: skip
    want = torch.autograd.grad(call(moba_attention_reference, q, keys, values, **gate), (q, keys, values), grad)
    tol = rounding_tol(torch.float64, nq, nk, d)
    for name, g, w in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=lambda m, n=name: f"d{n}: {m}")


# (B, Hq, Hkv, Nk, start, D, block, top_k, pooling, sink, local, top_p): one query, rows that start together
ONE_QUERY_CASES = [
    (2, 9, 3, 203, 0, 12, 16, 3, "mean", 0, 0, None),  # SmolLM2's GQA ratio, odd length, two max passes
    (3, 4, 2, 111, 5, 8, 16, 5, "mean", 0, 0, None),  # left padding, topk picks
    (1, 8, 8, 111, 0, 60, 16, 9, "mean", 0, 0, None),  # top_k >= blocks: dense
    (2, 4, 2, 129, 3, 8, 32, 1, "mean", 0, 0, None),  # top_k = 1, an own block of one key
    (3, 6, 3, 77, 2, 8, 8, 3, "bound", 1, 1, None),
    (2, 4, 2, 63, 0, 8, 6, 2, "mean+max", 2, 1, None),
    (2, 4, 1, 45, 4, 8, 5, 4, "max", 1, 2, 1.0),  # top_p = 1: the fixed budget
    (2, 4, 2, 40, 0, 8, 8, 2, "mean", 2, 2, None),  # sink + local + own cover every block: dense
    (2, 4, 2, 41, 0, 8, 8, 3, "mean", 1, 1, None),  # one candidate left over: gated
    (2, 2, 2, 9, 1, 4, 16, 3, "mean", 0, 0, None),  # block >= sequence
    (2, 4, 2, 48, 0, 8, 8, 3, "mean", 0, 0, None),  # the own block full
]


def _one_query_id(c):
    b, hq, hkv, nk, start, d, bs, k, pool, sink, local, top_p = c
    return f"B{b}-T{nk}-S{start}-H{hkv}-HQ{hq}-D{d}-blk{bs}-k{k}-{pool}-s{sink}l{local}-p{top_p}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ONE_QUERY_CASES, ids=_one_query_id)
def test_one_query_step_equals_the_reference_and_the_general_path(case, dtype, monkeypatch):
    """A step of `generate` (one query, rows starting together) takes `_one_query`: its selection equals the general
    path's exactly, its output the reference's of every row's sequence (dense when every block is attended)."""
    from moba_hf.kernels import decode as decode_kernels

    b, hq, hkv, nk, start, d, bs, k, pool, sink, local, top_p = case
    gate = dict(block_size=bs, top_k=k, pooling=pool, sink_blocks=sink, local_blocks=local, top_p=top_p)
    gen = torch.Generator().manual_seed(nk)
    q = torch.randn(b, hq, 1, d, dtype=dtype, generator=gen)
    keys, values = (torch.randn(b, hkv, nk, d, dtype=dtype, generator=gen) for _ in range(2))
    starts = None if start == 0 else torch.full((b,), start, dtype=torch.int32)
    block_keys = block_keys_from_cache(keys, bs, pool, starts)
    taken = force_path(monkeypatch, "one_query")
    out, chosen = moba_decode(q, keys, values, block_keys, starts=starts, return_selection=True, **gate)
    assert taken == ["_one_query"]
    monkeypatch.setattr(decode_kernels, "_common_start", lambda starts: None)
    general, want_chosen = moba_decode(q, keys, values, block_keys, starts=starts, return_selection=True, **gate)
    assert taken == ["_one_query", "_attend_in_place"]
    assert torch.equal(chosen, want_chosen)
    want = call(moba_attention_reference, q, keys[:, :, start:], values[:, :, start:], **gate)
    tol = rounding_tol(dtype, 1, nk, d)
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    torch.testing.assert_close(out, general, rtol=tol, atol=tol)


def test_one_query_step_leaves_the_thread_setting_alone(monkeypatch):
    """torch's intra-op thread count is partly process-wide (a thread started meanwhile takes it as its default):
    the step runs on the caller's threads and never sets them, with two threads as with one."""
    q = torch.randn(1, 4, 1, 8)
    keys, values = torch.randn(1, 2, 90, 8), torch.randn(1, 2, 90, 8)
    taken = force_path(monkeypatch, "one_query")
    before, set_threads, changed = torch.get_num_threads(), torch.set_num_threads, []
    set_threads(2)
    try:
        monkeypatch.setattr(torch, "set_num_threads", changed.append)
        moba_decode(q, keys, values, block_keys_from_cache(keys, 8), block_size=8, top_k=3)
    finally:
        set_threads(before)
    assert taken == ["_one_query"] and changed == []


@pytest.mark.parametrize("top_k", [2, 3, 5])
@pytest.mark.parametrize("poison", [None, float("nan"), float("inf"), float("-inf")])
def test_one_query_step_breaks_ties_as_the_general_path(poison, top_k, monkeypatch):
    """Blocks whose gate scores tie exactly (copies of one block, two blocks holding the same NaN / inf key): the
    one-query step picks the blocks `choose_blocks` picks."""
    from moba_hf.kernels import decode as decode_kernels

    b, hq, hkv, d, bs = 2, 6, 3, 8, 4
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(b, hq, 1, d, dtype=torch.float64, generator=gen)
    block = torch.randn(b, hkv, bs, d, dtype=torch.float64, generator=gen)
    keys = torch.cat([block, torch.randn(b, hkv, bs, d, dtype=torch.float64, generator=gen)] + [block] * 4, dim=2)
    keys = torch.cat([keys, torch.randn(b, hkv, 3, d, dtype=torch.float64, generator=gen)], dim=2)  # 7 blocks
    if poison is not None:
        keys[:, :, [1, 9, 13], 2] = poison  # blocks 0, 2 and 3
    values = torch.randn_like(keys)
    gate = dict(block_size=bs, top_k=top_k)
    block_keys = block_keys_from_cache(keys, bs)
    taken = force_path(monkeypatch, "one_query")
    out, chosen = moba_decode(q, keys, values, block_keys, return_selection=True, **gate)
    monkeypatch.setattr(decode_kernels, "_common_start", lambda starts: None)
    general, want = moba_decode(q, keys, values, block_keys, return_selection=True, **gate)
    assert taken == ["_one_query", "_attend_in_place"]
    assert torch.equal(chosen, want)
    torch.testing.assert_close(out, general, rtol=1e-12, atol=1e-12, equal_nan=True)


# --- the native step (CPU float32): the same gate, picks and attention as the torch ops -----------------------------
# (B, Hq, Hkv, Nk, start, D, block, top_k, pooling, sink, local): its vector paths (D a multiple of 8, runs of 8
# keys), their scalar tails, query groups up to 8, the picks of several rows reading one block once
NATIVE_CASES = [
    (1, 9, 3, 4097, 0, 64, 512, 3, "mean", 0, 0),  # SmolLM2's heads, block 512 / top 3, an own block of one key
    (2, 8, 1, 1000, 7, 128, 64, 4, "mean", 1, 1),  # one KV head for 8 query heads, left padding
    (3, 4, 4, 333, 0, 60, 32, 1, "mean", 0, 0),  # D not a multiple of 8, top_k = 1: no gate
    (2, 6, 2, 901, 3, 40, 100, 5, "bound", 0, 2),
    (1, 6, 3, 777, 0, 24, 16, 20, "mean+max", 2, 0),  # more picks than the max passes take
    (2, 4, 2, 517, 0, 8, 5, 3, "max", 1, 1),  # segments shorter than a run of 8 keys
]


def _native_id(c):
    return "B{}-HQ{}-H{}-T{}-S{}-D{}-blk{}-k{}-{}-s{}l{}".format(*c)


def _without_native(monkeypatch) -> None:
    from moba_hf.kernels import decode as decode_kernels

    monkeypatch.setattr(decode_kernels, "_native_one_query", lambda *args: None)


def _needs_native() -> None:
    from moba_hf.kernels import native

    if not native.available():
        pytest.skip("no C compiler here: the native step is not built")


# the build for this CPU (its vector paths where it has AVX2 and FMA), one for the architecture's baseline (the
# plain loops a CPU without them runs), and the one a compiler without OpenMP makes (one thread)
PORTABLE_FLAGS = ("-O2", "-fopenmp", "-fPIC", "-shared")


@pytest.fixture(params=["this-cpu", "portable", "serial"])
def native_build(request, monkeypatch, tmp_path):
    from moba_hf.kernels import native

    _needs_native()
    if request.param != "this-cpu":
        flags = PORTABLE_FLAGS if request.param == "portable" else native.SERIAL_FLAGS
        monkeypatch.setenv("MOBA_HF_CACHE", str(tmp_path))
        monkeypatch.setattr(native, "_loaded", native.load(native.build(native._compiler(), flags)))
    return request.param


def _native_inputs(case):
    """(gate keywords, q, keys, values, starts, block keys) of a NATIVE_CASES entry."""
    b, hq, hkv, nk, start, d, bs, k, pool, sink, local = case
    gate = dict(block_size=bs, top_k=k, pooling=pool, sink_blocks=sink, local_blocks=local)
    gen = torch.Generator().manual_seed(nk)
    q = torch.randn(b, hq, 1, d, generator=gen)
    keys, values = (torch.randn(b, hkv, nk, d, generator=gen) for _ in range(2))
    starts = None if start == 0 else torch.full((b,), start)
    return gate, q, keys, values, starts, block_keys_from_cache(keys, bs, pool, starts)


@pytest.mark.parametrize("case", NATIVE_CASES, ids=_native_id)
def test_native_step_equals_the_torch_ops_and_the_reference(case, native_build, monkeypatch):
    """The native step picks the torch ops' blocks exactly and attends as they and the reference do, up to rounding
    (one dot product per key, a softmax over the read keys, a sum of value rows)."""
    gate, q, keys, values, starts, block_keys = _native_inputs(case)
    nk, start, d = case[3], case[4], case[5]
    taken = force_path(monkeypatch, "one_query")
    from moba_hf.kernels import decode as decode_kernels

    native_calls = []
    real = decode_kernels.native.decode_step
    monkeypatch.setattr(decode_kernels.native, "decode_step", lambda *a: native_calls.append(1) or real(*a))
    out, chosen = moba_decode(q, keys, values, block_keys, starts=starts, return_selection=True, **gate)
    assert taken == ["_one_query"] and native_calls == [1]
    _without_native(monkeypatch)
    ops, ops_chosen = moba_decode(q, keys, values, block_keys, starts=starts, return_selection=True, **gate)
    assert torch.equal(chosen, ops_chosen)
    tol = rounding_tol(torch.float32, nk, d)
    torch.testing.assert_close(out, ops, rtol=tol, atol=tol)
    want = call(moba_attention_reference, q, keys[:, :, start:], values[:, :, start:], **gate)
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", NATIVE_CASES[:2], ids=_native_id)
def test_native_step_gives_the_same_bits_on_any_number_of_threads(case, monkeypatch):
    """Each work item is computed alike on any thread and the rows' shares are combined in one order: one thread and
    several give the same bits (so a step may run on one thread when the machine is busy and change no result)."""
    _needs_native()
    gate, q, keys, values, starts, block_keys = _native_inputs(case)
    force_path(monkeypatch, "one_query")
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 4, 1):
            torch.set_num_threads(threads)
            outs.append(moba_decode(q, keys, values, block_keys, starts=starts, **gate))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_native_step_carries_nan_and_inf_as_the_torch_ops(which, value, native_build, monkeypatch):
    """Every position poisoned in turn (gated, own and unpicked blocks, the gate's pooled keys through k): the
    native step gives the torch ops' picks and NaN / inf pattern, and their finite values."""
    from moba_hf.kernels import decode as decode_kernels

    b, hq, hkv, nk, d, bs = 2, 6, 2, 75, 16, 8
    gate = dict(block_size=bs, top_k=3)
    gen = torch.Generator().manual_seed(2)
    q0 = torch.randn(b, hq, 1, d, generator=gen)
    k0, v0 = (torch.randn(b, hkv, nk, d, generator=gen) for _ in range(2))
    force_path(monkeypatch, "one_query")
    native_step = decode_kernels._native_one_query
    for index in range(nk if which != "q" else 1):
        q, k, v = q0.clone(), k0.clone(), v0.clone()
        {"q": q, "k": k, "v": v}[which][1, 0, index, 3] = value
        block_keys = block_keys_from_cache(k, bs)
        monkeypatch.setattr(decode_kernels, "_native_one_query", native_step)
        got, chosen = moba_decode(q, k, v, block_keys, return_selection=True, **gate)
        _without_native(monkeypatch)
        want, want_chosen = moba_decode(q, k, v, block_keys, return_selection=True, **gate)
        assert torch.equal(chosen, want_chosen), (which, index)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), (which, index)
        finite = want.isfinite()
        tol = rounding_tol(torch.float32, nk, d)
        torch.testing.assert_close(got[finite], want[finite], rtol=tol, atol=tol)
        assert torch.equal(got[~finite], want[~finite]) or bool(got[~finite].isnan().all())


@pytest.mark.parametrize("top_k", [2, 3])  # the max passes' picks (more picks: topk, any of equal ones)
@pytest.mark.parametrize("poison", [None, float("nan"), float("inf"), float("-inf")])
def test_native_step_breaks_ties_by_index(poison, top_k, native_build, monkeypatch):
    """Copies of one block tie exactly in the native gate, whether it scores them in a run of 8 or alone: it picks
    the first of equal ones, as `choose_blocks` does on scores that tie exactly (those of float64 here; float32
    matrix products may round equal columns apart)."""
    b, hq, hkv, d, bs = 2, 6, 3, 8, 4
    gen = torch.Generator().manual_seed(3)
    block = torch.randn(b, hkv, bs, d, generator=gen)
    keys = torch.cat([block, torch.randn(b, hkv, bs, d, generator=gen)] + [block] * 8, dim=2)
    keys = torch.cat([keys, torch.randn(b, hkv, 3, d, generator=gen)], dim=2)  # 11 blocks: 10 candidates
    if poison is not None:
        keys[:, :, [1, 9, 13], 2] = poison  # blocks 0, 2 and 3
    q, values = torch.randn(b, hq, 1, d, generator=gen), torch.randn_like(keys)
    gate = dict(block_size=bs, top_k=top_k)
    force_path(monkeypatch, "one_query")
    _, chosen = moba_decode(q, keys, values, block_keys_from_cache(keys, bs), return_selection=True, **gate)
    wide = [t.double() for t in (q, keys, values)]
    _, want = moba_decode(*wide, block_keys_from_cache(wide[1], bs), return_selection=True, **gate)
    assert torch.equal(chosen, want)


def _native_probe(cache: Path, cc: str | None) -> dict:
    """In a fresh interpreter with MOBA_HF_CACHE=cache (and CC=cc): whether the native step is available, the built
    files, and a decode step's output."""
    code = """
import json, torch
from moba_hf.kernels import native
from moba_hf.kernels.decode import block_keys_from_cache, moba_decode
gen = torch.Generator().manual_seed(0)
q = torch.randn(1, 4, 1, 16, generator=gen)
k, v = (torch.randn(1, 2, 200, 16, generator=gen) for _ in range(2))
out = moba_decode(q, k, v, block_keys_from_cache(k, 16), block_size=16, top_k=3)
print(json.dumps({"available": native.available(), "out": out.flatten().tolist()}))
"""
    env = {**os.environ, "MOBA_HF_CACHE": str(cache)}
    if cc is not None:
        env["CC"] = cc
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    built = {str(p.relative_to(cache)): p.stat().st_mtime_ns for p in cache.rglob("*.so")}
    return {**found, "built": built}


def test_the_native_step_is_built_once_and_without_a_compiler_the_torch_ops_run(tmp_path):
    """A first process builds the kernel into $MOBA_HF_CACHE, a second loads that file; a process without a C
    compiler, or whose cache directory cannot be made, runs the torch ops and computes the same step."""
    _needs_native()
    first = _native_probe(tmp_path / "cache", None)
    second = _native_probe(tmp_path / "cache", None)
    assert first["available"] and len(first["built"]) == 1
    assert second["built"] == first["built"]  # the same file, not rebuilt
    bare = _native_probe(tmp_path / "bare", str(tmp_path / "no-such-cc"))
    assert not bare["available"] and bare["built"] == {}
    (tmp_path / "a-file").write_text("")
    unwritable = _native_probe(tmp_path / "a-file" / "cache", None)  # the cache directory cannot be made
    assert not unwritable["available"]
    tol = rounding_tol(torch.float32, 200, 16)
    for other in (bare, unwritable):
        torch.testing.assert_close(torch.tensor(other["out"]), torch.tensor(first["out"]), rtol=tol, atol=tol)
    assert second["out"] == first["out"]


@pytest.mark.parametrize(
    "path, nq, top_k",
    [(path, 2, 3) for path in PATHS] + [("one_query", 1, 3), ("one_query", 1, 6), ("in_place", 1, 3)],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_decode_paths_carry_nan_and_inf_like_the_reference(which, value, path, nq, top_k, monkeypatch):
    """Every position of a 3-row batch poisoned in turn (own block, gated blocks, the part of a shifted last window
    before its block, unselected blocks): the same NaN / inf pattern as the reference, the same finite values.
    top_k 6 of 6 blocks: the one-query path's dense attention."""
    force_path(monkeypatch, path)
    b, hq, hkv, nk, d, bs = 3, 4, 2, 43, 8, 8
    gate = dict(block_size=bs, top_k=top_k)
    gen = torch.Generator().manual_seed(1)
    q0, k0, v0 = (
        torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) for h, n in ((hq, nq), (hkv, nk), (hkv, nk))
    )
    for index in range(0, nk if which != "q" else nq, 3 if which != "q" else 1):
        q, k, v = q0.clone(), k0.clone(), v0.clone()
        {"q": q, "k": k, "v": v}[which][1, 0, index, 2] = value
        got = moba_decode(q, k, v, block_keys_from_cache(k, bs), **gate)
        want = call(moba_attention_reference, q, k, v, **gate)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), (which, index)
        finite = want.isfinite()
        tol = rounding_tol(torch.float64, nq, nk, d)
        torch.testing.assert_close(got[finite], want[finite], rtol=tol, atol=tol)
        assert torch.equal(got[~finite], want[~finite]) or bool(got[~finite].isnan().all())


def test_float32_takes_the_in_place_path_and_bfloat16_the_windows(monkeypatch):
    from moba_hf.kernels import decode as decode_kernels

    taken = []
    for name in ("_attend_in_place", "_attend_windows", "_one_query"):
        real = getattr(decode_kernels, name)
        monkeypatch.setattr(decode_kernels, name, lambda *a, _r=real, _n=name: taken.append(_n) or _r(*a))
    q = torch.randn(1, 4, 1, 16)
    keys, values = torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)
    for dtype in (torch.float32, torch.bfloat16):
        qd, kd, vd = (t.to(dtype) for t in (q, keys, values))
        out = moba_decode(qd, kd, vd, block_keys_from_cache(kd, 8), block_size=8, top_k=3)
        want = call(moba_attention_reference, qd, kd, vd, block_size=8, top_k=3)
        assert out.dtype == dtype
        tol = rounding_tol(torch.float32, 1, 70, 16) if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
        torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    assert taken == ["_one_query", "_attend_windows"]


def _spy_paths(monkeypatch) -> list[str]:
    """The decode paths taken (none forced), appended in call order."""
    from moba_hf.kernels import decode as decode_kernels

    taken = []
    for name in ("_attend_in_place", "_attend_windows", "_one_query"):
        real = getattr(decode_kernels, name)
        monkeypatch.setattr(decode_kernels, name, lambda *a, _r=real, _n=name: taken.append(_n) or _r(*a))
    return taken


# (B, Hq, Hkv, Nk, Nq, D, block, top_k, pooling, sink, local, starts, path)
PREFIX_CASES = [
    (2, 9, 3, 203, 1, 12, 16, 3, "mean", 0, 0, None, "_one_query"),  # GQA, batch 2
    (3, 4, 2, 111, 1, 8, 16, 5, "mean", 0, 0, [5, 5, 5], "_one_query"),  # rows left-padded alike
    (1, 8, 8, 111, 1, 60, 16, 9, "mean", 0, 0, None, "_one_query"),  # every block: dense
    (3, 6, 3, 45, 1, 8, 5, 3, "bound", 1, 1, [0, 3, 7], "_attend_in_place"),  # left padding of different widths
    (3, 4, 1, 50, 2, 8, 7, 4, "mean+max", 0, 1, [0, 3, 7], "_attend_in_place"),  # one KV head
    (2, 12, 4, 77, 8, 8, 8, 3, "mean", 0, 0, None, "_attend_in_place"),  # several queries
    (1, 6, 2, 64, 3, 16, 8, 2, "max", 1, 0, None, "_attend_in_place"),  # batch 1
]


def _prefix_id(c):
    b, hq, hkv, nk, nq, d, bs, k, pool, sink, local, starts, path = c
    return f"B{b}-T{nk}-Q{nq}-H{hkv}-HQ{hq}-D{d}-blk{bs}-k{k}-{pool}-s{sink}l{local}-S{starts}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", PREFIX_CASES, ids=_prefix_id)
def test_a_prefix_view_of_a_larger_cache_is_read_in_place_as_its_copy(case, dtype, monkeypatch):
    """The written slots of a pre-allocated cache, k[:, :, :Nk] of a [B, Hkv, capacity, D] buffer: the in-place
    paths read them where they lie (the slots after them hold NaN: a read there would show), with the very
    result and selection of a contiguous copy."""
    b, hq, hkv, nk, nq, d, bs, k, pool, sink, local, starts, path = case
    gate = dict(block_size=bs, top_k=k, pooling=pool, sink_blocks=sink, local_blocks=local)
    gen = torch.Generator().manual_seed(nk)
    q = torch.randn(b, hq, nq, d, dtype=dtype, generator=gen)
    buffers = [torch.full((b, hkv, nk + 13, d), float("nan"), dtype=dtype) for _ in range(2)]
    for buf in buffers:
        buf[:, :, :nk] = torch.randn(b, hkv, nk, d, dtype=dtype, generator=gen)
    keys, values = (buf[:, :, :nk] for buf in buffers)
    assert not keys.is_contiguous()
    starts = None if starts is None else torch.tensor(starts)
    block_keys = block_keys_from_cache(keys.contiguous(), bs, pool, starts)
    taken = _spy_paths(monkeypatch)
    out, chosen = moba_decode(q, keys, values, block_keys, starts=starts, return_selection=True, **gate)
    want, want_chosen = moba_decode(
        q, keys.contiguous(), values.contiguous(), block_keys, starts=starts, return_selection=True, **gate
    )
    expected = ["_one_query", "_one_query"] if path == "_one_query" else ["_attend_in_place"] * 2
    assert taken == expected
    assert torch.equal(chosen, want_chosen)
    assert torch.equal(out, want)


@pytest.mark.parametrize("layout", ["heads interleaved", "keys and values of other capacities"])
def test_caches_the_in_place_paths_cannot_index_are_copied(layout, monkeypatch):
    """A cache whose (row, head) runs are not evenly spaced rows of the storage (heads interleaved), or keys and
    values spaced differently: the windowed path, the same result."""
    b, hq, hkv, nk, d = 2, 4, 2, 45, 8
    q = torch.randn(b, hq, 1, d, dtype=torch.float64)
    keys, values = torch.randn(b, hkv, nk, d, dtype=torch.float64), torch.randn(b, hkv, nk, d, dtype=torch.float64)
    if layout == "heads interleaved":
        strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (keys, values)]
    else:
        strided = [keys, torch.cat([values, torch.zeros(b, hkv, 3, d, dtype=torch.float64)], dim=2)[:, :, :nk]]
    taken = _spy_paths(monkeypatch)
    gate = dict(block_size=5, top_k=3)
    out = moba_decode(q, *strided, block_keys_from_cache(keys, 5), **gate)
    assert taken == ["_attend_windows"]
    want = call(moba_attention_reference, q, keys, values, **gate)
    tol = rounding_tol(torch.float64, 1, nk, d)
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "starts, message",
    [
        (torch.tensor([0.0, 3.0]), "got a torch.float32 tensor [0.0, 3.0]"),
        (torch.tensor([0.5, 3.0], dtype=torch.float64), "got a torch.float64 tensor [0.5, 3.0]"),
        (torch.tensor([True, False]), "got a torch.bool tensor [True, False]"),
        ([0, 3], "got list [0, 3]"),
        (torch.tensor([0, 3, 1]), "got shape (3,)"),
    ],
    ids=["float32", "float64", "bool", "list", "shape"],
)
def test_decode_refuses_starts_that_are_not_integer_positions(starts, message):
    q, keys = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 20, 8)
    accepted = "starts must be None or a [B=2] integer tensor (int64, int32, int16, int8 or uint8) of cache positions"
    with pytest.raises(ValueError, match=re.escape(f"{accepted}, {message}")):
        moba_decode(q, keys, keys, block_keys_from_cache(keys, 4), block_size=4, top_k=2, starts=starts)


@pytest.mark.parametrize("starts", [[-1, 0], [0, 20]])
def test_decode_refuses_starts_out_of_range(starts):
    q, keys = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 20, 8)
    message = f"starts must be [B=2] cache positions in 0..19 (at least Nq=1 tokens after them, Nk=20), got {starts}"
    with pytest.raises(ValueError, match=re.escape(message)):
        moba_decode(q, keys, keys, block_keys_from_cache(keys, 4), block_size=4, top_k=2, starts=torch.tensor(starts))


def test_decode_accepts_every_integer_starts_dtype():
    q, keys = torch.randn(2, 4, 1, 8, dtype=torch.float64), torch.randn(2, 2, 20, 8, dtype=torch.float64)
    want = moba_decode(q, keys, keys, block_keys_from_cache(keys, 4, starts=torch.tensor([0, 5])), block_size=4,
                       top_k=2, starts=torch.tensor([0, 5]))  # fmt: skip
    for dtype in (torch.int32, torch.int16, torch.int8, torch.uint8):
        starts = torch.tensor([0, 5], dtype=dtype)
        got = moba_decode(q, keys, keys, block_keys_from_cache(keys, 4, starts=starts.long()), block_size=4,
                          top_k=2, starts=starts)  # fmt: skip
        assert torch.equal(got, want)


def test_decode_refuses_integer_block_keys():
    q, keys = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 20, 8)
    with pytest.raises(
        ValueError, match="block_keys must be a floating-point tensor \\(the pooled keys\\), got torch.int64"
    ):
        moba_decode(q, keys, keys, torch.zeros(1, 2, 5, 8, dtype=torch.long), block_size=4, top_k=2)


def test_decode_kernel_float32_and_bad_args():
    q = torch.randn(1, 4, 1, 16)
    keys, values = torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)
    out = moba_decode(q, keys, values, block_keys_from_cache(keys, 8), block_size=8, top_k=3)
    want = call(moba_attention_reference, q, keys, values, block_size=8, top_k=3)
    assert out.dtype == torch.float32
    tol = rounding_tol(torch.float32, 1, 70, 16)
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="top_k must be an integer >= 1, got 0"):
        moba_decode(q, keys, values, block_keys_from_cache(keys, 8), block_size=8, top_k=0)
    with pytest.raises(ValueError, match="block_keys"):
        moba_decode(q, keys, values, block_keys_from_cache(keys, 8)[:, :, :3], block_size=8, top_k=3)


# --- the running block state ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("padded", [True, False])  # rows of different lengths / one length (one-block updates)
@pytest.mark.parametrize("read_every", [1, 3])  # pooled keys re-derived for the blocks of several appends at once
@pytest.mark.parametrize("pooling", ["mean", "max", "mean+max", "bound"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])  # float32: decode steps' native block update
def test_block_state_equals_recomputation_after_every_append(pooling, read_every, padded, dtype):
    bs, b, hkv, d = 4, 3, 2, 5
    keys = torch.randn(b, hkv, 44, d, dtype=dtype)
    real = torch.ones(b, 44, dtype=torch.bool)
    if padded:
        real[1, :3] = False  # left padding
        real[2, :9] = False
    state = moba_cache.BlockState(keys, bs, pooling)
    n = 0
    for i, chunk in enumerate((11, 1, 1, 7, 1, 1, 1, 5, 12, 1, 1, 1, 1)):  # prefill, decode steps, chunks
        state.append(keys[:, :, n : n + chunk], real[:, n : n + chunk])
        n += chunk
        assert state.n == n and state.contiguous_rows()
        starts = state.starts.tolist()
        assert state.common_start == (starts[0] if len(set(starts)) == 1 else None)
        if i % read_every:
            continue
        assert state.counts.tolist() == real[:, :n].sum(-1).tolist()
        want = block_keys_from_cache(keys[:, :, :n], bs, pooling, state.starts)
        # a block's sum of bs keys, added in another order: bs roundings of the largest key
        tol = rounding_tol(dtype, bs) * float(keys.abs().max())
        torch.testing.assert_close(state.block_keys(), want, rtol=0, atol=tol)


@pytest.mark.parametrize("pooling", ["mean", "max", "mean+max", "bound"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_native_block_update_equals_the_torch_ops(pooling, poison, native_build, monkeypatch):
    """A decode step's block update (one key per row merged into its block, the pooled key re-derived) in one
    native call equals the torch ops', NaN and inf included, on a static cache's strided new keys."""
    from moba_hf.kernels import native

    bs, b, hkv, d, n = 4, 2, 3, 16, 23
    keys = torch.randn(b, hkv, 40, d)[:, :, :n]  # a prefix view: the new keys' rows lie 40 * d apart
    keys[1, 2, 13, 5] = poison
    states = []
    for use_native in (True, False):
        if not use_native:
            monkeypatch.setattr(native, "block_append", lambda *args: False)
        state = moba_cache.BlockState(keys, bs, pooling)
        state.append(keys[:, :, :9], None)
        for i in range(9, n):
            state.append(keys[:, :, i : i + 1], None)
            states.append(state.block_keys().clone())
    half = len(states) // 2
    for got, want in zip(states[:half], states[half:], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_block_state_keeps_the_rows_common_start_on_the_host():
    """The start every row shares (what a decode step reads instead of reducing `starts`), None once rows start
    apart."""
    keys = torch.randn(2, 1, 9, 2)
    state = moba_cache.BlockState(keys, 4, "mean")
    state.append(keys[:, :, :3], torch.tensor([[False, False, False], [False, False, False]]))
    assert state.common_start == 3 and state.starts.tolist() == [3, 3]
    state.append(keys[:, :, 3:5], torch.tensor([[False, True], [True, True]]))
    assert state.common_start is None and state.starts.tolist() == [4, 3]
    state.append(keys[:, :, 5:6], None)
    assert state.common_start is None
    state = moba_cache.BlockState(keys, 4, "mean")
    state.append(keys[:, :, :1], torch.tensor([[False], [False]]))
    state.append(keys[:, :, 1:2], None)  # every row's first real token, in an all-real step
    assert state.common_start == 1 and state.starts.tolist() == [1, 1]


def test_block_state_notices_a_gap():
    keys = torch.randn(1, 1, 6, 2)
    state = moba_cache.BlockState(keys, 4, "mean")
    state.append(keys[:, :, :4], torch.tensor([[True, True, False, False]]))  # right padding
    assert not state.contiguous_rows()


# --- tiny models: cached decoding == one forward without cache ------------------------------------------------------
MODEL_TOL = model_tol(TINY, 45)  # sequences here are at most 45 tokens
# the forward's cache keyword: "cache" in transformers >= 5.2x, "past_key_values" before
CACHE = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


class Spy:
    """Counts sparse decode calls and block-state (re)builds while active."""

    def __init__(self, monkeypatch):
        self.decodes = 0
        self.builds = 0
        real_decode, real_init = moba_cache.core.decode, moba_cache.BlockState.__init__

        def decode(*args, **kwargs):
            self.decodes += 1
            return real_decode(*args, **kwargs)

        def init(state, *args, **kwargs):
            self.builds += 1
            real_init(state, *args, **kwargs)

        monkeypatch.setattr(moba_cache.core, "decode", decode)
        monkeypatch.setattr(moba_cache.BlockState, "__init__", init)


_ORACLE = "moba_test_full_decode_oracle"
_oracle_dense = [0, None]


def _full_decode_oracle(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """No cache: dense causal for the queries in positions [first, end) (decode="full": all after the prompt),
    MoBA for the others."""
    out, _ = moba_hf.integration.moba_attention_forward(module, query, key, value, attention_mask, scaling, **kwargs)
    dense = causal_attention(query, key, value, scale=scaling).transpose(1, 2)
    first, end = _oracle_dense
    end = out.shape[1] if end is None else end
    return torch.cat([out[:, :first], dense[:, first:end], out[:, end:]], dim=1), None


def _full_forward(model, ids, decode, prompt, dense_end=None):
    if decode == "moba" and dense_end is None:
        return model(ids).logits
    AttentionInterface.register(_ORACLE, _full_decode_oracle)
    AttentionMaskInterface.register(_ORACLE, moba_mask)
    _oracle_dense[:] = [prompt, dense_end]
    model.set_attn_implementation(_ORACLE)
    try:
        return model(ids).logits
    finally:
        model.set_attn_implementation("moba")


# a fixed budget, and an adaptive one (each query's blocks depend on its gate's softmax)
BUDGETS = {"fixed": {"top_k": 2}, "top-p": {"top_k": 4, "top_p": 0.6, "min_top_k": 2}}


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("decode", ["moba", "full"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_stepwise_cached_decoding_equals_full_forward(arch, decode, budget, monkeypatch):
    moba = MobaConfig(block_size=5, decode=decode, **BUDGETS[budget])
    model = tiny_model(arch, moba)
    spy = Spy(monkeypatch)
    ids = torch.randint(0, 97, (2, 29))  # 6 blocks, the last one partial
    prompt = 8
    with torch.no_grad():
        want = _full_forward(model, ids, decode, prompt)
        cache = DynamicCache(config=model.config)
        got = [model(ids[:, :prompt], **{CACHE: cache}, use_cache=True).logits]
        for t in range(prompt, ids.shape[1]):
            got.append(model(ids[:, t : t + 1], **{CACHE: cache}, use_cache=True).logits)
            if decode == "moba":  # the running block means equal a recomputation after every step
                for layer, state in moba_state.of_cache(cache).blocks.items():
                    keys = cache.layers[layer].keys
                    tol = rounding_tol(torch.float64, 5) * float(keys.abs().max())  # bs roundings, as above
                    torch.testing.assert_close(state.block_keys(), block_keys_from_cache(keys, 5), rtol=0, atol=tol)
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=MODEL_TOL, atol=MODEL_TOL)
    steps = ids.shape[1] - prompt
    if decode == "moba":
        layers = model.config.num_hidden_layers
        assert (spy.decodes, spy.builds) == (steps * layers, layers)  # built once, then only appended to
    else:
        assert spy.decodes == 0


_DECODE_BUDGET = "moba_test_decode_budget_oracle"


def _decode_budget_oracle(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """No cache: the queries after the prompt attend with decode_top_k (each query's blocks are its own, so one
    call over all of them gives every decode step's rows), the prompt's with top_k."""
    out, _ = moba_hf.integration.moba_attention_forward(module, query, key, value, attention_mask, scaling, **kwargs)
    plan = moba_hf.integration.attention.resolved_config(module).plan
    steps = attend_plan(query, key, value, plan.blocks(1), scaling).transpose(1, 2)
    first = _oracle_dense[0]
    return torch.cat([out[:, :first], steps[:, first:]], dim=1), None


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_decode_top_k_is_the_budget_of_every_decode_step(arch):
    moba = MobaConfig(block_size=5, top_k=2, decode_top_k=4)
    model = tiny_model(arch, moba)
    ids = torch.randint(0, 97, (2, 29))
    prompt = 8
    with torch.no_grad():
        AttentionInterface.register(_DECODE_BUDGET, _decode_budget_oracle)
        AttentionMaskInterface.register(_DECODE_BUDGET, moba_mask)
        _oracle_dense[:] = [prompt, None]
        model.set_attn_implementation(_DECODE_BUDGET)
        want = model(ids).logits
        model.set_attn_implementation("moba")
        plain = model(ids).logits
        cache = DynamicCache(config=model.config)
        got = [model(ids[:, :prompt], **{CACHE: cache}, use_cache=True).logits]
        for t in range(prompt, ids.shape[1]):
            got.append(model(ids[:, t : t + 1], **{CACHE: cache}, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=MODEL_TOL, atol=MODEL_TOL)
    assert not torch.allclose(want, plain, rtol=MODEL_TOL, atol=MODEL_TOL)  # the larger budget changed the steps


# --- decode="moba" is MoBA at every step, on every machine and in every process ------------------------------------
GREEDY = MobaConfig(block_size=4, top_k=2, decode="moba")
PROMPT, NEW = 6, 26  # decode steps over caches of 7 .. 31 tokens: 2 .. 8 blocks
_GENERATE = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from tiny_models import tiny_model
from moba_hf import MobaConfig
torch.manual_seed(0)
model = tiny_model("llama", MobaConfig(block_size=4, top_k=2, decode="moba"))
ids = torch.randint(0, 97, (2, {prompt}))
out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens={new}, do_sample=False, eos_token_id=None)
print(json.dumps(out.tolist()))
"""


def _greedy(arch: str):
    """Greedy tokens (no end token: NEW of them, each the argmax of its logits) and their logits."""
    torch.manual_seed(0)  # the weights and prompt _GENERATE builds
    model = tiny_model(arch, GREEDY)
    ids = torch.randint(0, 97, (2, PROMPT))
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    return model, out.sequences, torch.stack(out.logits, dim=1)  # [B, NEW, vocab]: each token's logits


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_cached_greedy_decoding_equals_the_full_forward_of_each_prefix(arch, monkeypatch):
    # nothing in the environment decides the math (a variable of that name is read by nothing)
    monkeypatch.setenv("MOBA_HF_DECODE_CROSSOVER", "1000")
    spy = Spy(monkeypatch)
    model, seq, logits = _greedy(arch)
    with torch.no_grad():
        full = model(seq[:, :-1]).logits[:, PROMPT - 1 :]  # the forward without a cache, every prefix at once
    # generate hands back float32 logits: one float32 rounding on top of the float64 model's
    tol = MODEL_TOL + torch.finfo(torch.float32).eps * float(full.abs().max())
    torch.testing.assert_close(logits.double(), full, rtol=0, atol=tol)
    assert torch.equal(full.argmax(-1), seq[:, PROMPT:])
    assert spy.decodes == (NEW - 1) * model.config.num_hidden_layers  # every step sparse, from the first block on
    # the check can fail: dense decode steps over the same caches give other logits
    with torch.no_grad():
        dense = _full_forward(model, seq[:, :-1], "full", PROMPT)[:, PROMPT - 1 :]
    assert float((dense - full).abs().max()) > 1e3 * MODEL_TOL


def test_a_second_process_on_a_loaded_machine_generates_the_same_tokens(monkeypatch):
    monkeypatch.delenv("MOBA_HF_DECODE_CROSSOVER", raising=False)
    model, want, _ = _greedy("llama")
    with torch.no_grad():  # each token is the argmax of the full forward of its prefix
        assert torch.equal(model(want[:, :-1]).logits[:, PROMPT - 1 :].argmax(-1), want[:, PROMPT:])
    code = _GENERATE.format(tests=str(Path(__file__).parent), prompt=PROMPT, new=NEW)
    env = {k: v for k, v in os.environ.items() if k != "MOBA_HF_DECODE_CROSSOVER"}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]  # both cores taken
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == want.tolist()


@pytest.mark.parametrize("budget", [{}, {"top_p": 0.5}], ids=["fixed", "top-p"])
@pytest.mark.parametrize("decode", ["moba", "full"])
def test_chunked_prefill_equals_one_prefill(decode, budget, monkeypatch):
    moba = MobaConfig(block_size=4, top_k=3, decode=decode, **budget)
    model = tiny_model("llama", moba)
    spy = Spy(monkeypatch)
    ids = torch.randint(0, 97, (2, 45))
    with torch.no_grad():
        want = model(ids).logits
        cache = DynamicCache(config=model.config)
        got, t = [], 0
        # <= 8 new tokens: the decode kernel; more: the prefill kernel. (decode="full" makes 1-token steps dense.)
        chunks = (9, 3, 12, 1, 2, 11, 1, 6) if decode == "moba" else (9, 3, 12, 2, 2, 11, 6)
        for chunk in chunks:
            got.append(model(ids[:, t : t + chunk], **{CACHE: cache}, use_cache=True).logits)
            t += chunk
    assert t == ids.shape[1]
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=MODEL_TOL, atol=MODEL_TOL)
    if decode == "moba":
        assert spy.decodes == 5 * 2 and spy.builds == 2  # state kept in step through the long chunks


def test_state_is_rebuilt_after_reset_and_crop(monkeypatch):
    model = tiny_model("llama", MobaConfig(block_size=4, top_k=2))
    spy = Spy(monkeypatch)
    ids = torch.randint(0, 97, (1, 30))
    with torch.no_grad():
        want = model(ids).logits
        cache = DynamicCache(config=model.config)
        model(torch.randint(0, 97, (1, 17)), **{CACHE: cache}, use_cache=True)
        model(torch.randint(0, 97, (1, 1)), **{CACHE: cache}, use_cache=True)
        cache.reset()  # same cache object, new conversation
        model(ids[:, :20], **{CACHE: cache}, use_cache=True)
        cache.crop(-8)  # back to 12 tokens, e.g. rejected speculative tokens
        got = [model(ids[:, 12:13], **{CACHE: cache}, use_cache=True).logits]
        for t in range(13, 30):
            got.append(model(ids[:, t : t + 1], **{CACHE: cache}, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(got, dim=1), want[:, 12:], rtol=MODEL_TOL, atol=MODEL_TOL)
    assert spy.builds == 2 * 2  # first decode step, then once after reset + crop


def test_generate_uses_sparse_decode_and_matches_stepwise_argmax(monkeypatch):
    model = tiny_model("qwen2", MobaConfig(block_size=4, top_k=2))
    spy = Spy(monkeypatch)
    ids = torch.randint(0, 97, (1, 13))
    out = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert spy.decodes == 11 * 2 and spy.builds == 2
    with torch.no_grad():  # greedy: every generated token is the argmax of a full forward over its prefix
        logits = model(out[:, :-1]).logits
    assert torch.equal(logits[:, 12:].argmax(-1), out[:, 13:])


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_sparse_decode_is_tracked(kind, monkeypatch):
    """Tracked steps record the pairs the selection attends; untracked steps do not ask for the selection."""
    from transformers import StaticCache

    model = tiny_model("llama", MobaConfig(block_size=4, top_k=2))
    ids = torch.randint(0, 97, (1, 41))
    cache = (
        DynamicCache(config=model.config) if kind == "dynamic" else StaticCache(config=model.config, max_cache_len=48)
    )
    asked = []
    real = moba_cache.core.decode
    monkeypatch.setattr(
        moba_cache.core, "decode", lambda *a, **kw: asked.append(kw["return_selection"]) or real(*a, **kw)
    )
    with torch.no_grad():
        model(ids[:, :40], **{CACHE: cache}, use_cache=True)
        model(ids[:, 40:41], **{CACHE: cache}, use_cache=True)  # installs the hooks' view of this cache
        assert asked == [False, False]  # a step not tracked: no selection asked for
        with moba_hf.track_sparsity() as stats:
            model(torch.randint(0, 97, (1, 1)), **{CACHE: cache}, use_cache=True)
    assert asked == [False, False, True, True]
    # the query at position 41 (block 10) reads its own 2 keys and one full earlier block
    assert stats.backends == {0: "decode", 1: "decode"}
    for sparsity in stats.per_layer().values():
        assert sparsity == pytest.approx(1 - 6 / 42)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_static_cache_sliding_window_layers_refused(compiled):
    """A pre-allocated cache whose layer keeps a window of the last tokens (not every key): refused by name, also
    under torch.compile, where the attention runs as a custom op that never sees the cache."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticSlidingWindowLayer

    model = tiny_model("llama", MobaConfig(block_size=4, top_k=2))
    cache = StaticCache(config=model.config, max_cache_len=32)
    cache.layers[1] = StaticSlidingWindowLayer(max_cache_len=32, sliding_window=8)
    if compiled:
        torch._dynamo.reset()
    forward = torch.compile(model) if compiled else model
    with pytest.raises(ValueError, match="StaticSlidingWindowLayer"), torch.no_grad():
        for _ in range(2):
            forward(torch.randint(0, 97, (1, 4)), **{CACHE: cache}, use_cache=True)


@pytest.mark.cuda
def test_decode_kernel_on_cuda_matches_reference():
    dev = torch.device("cuda")
    q = torch.randn(2, 9, 1, 64, device=dev)
    keys, values = torch.randn(2, 3, 3000, 64, device=dev), torch.randn(2, 3, 3000, 64, device=dev)
    starts = torch.tensor([0, 517], device=dev)
    out = moba_decode(
        q, keys, values, block_keys_from_cache(keys, 256, "mean", starts), block_size=256, top_k=3, starts=starts
    )
    for r in range(2):
        s = int(starts[r])
        want = call(
            moba_attention_reference,
            q[r : r + 1],
            keys[r : r + 1, :, s:],
            values[r : r + 1, :, s:],
            block_size=256,
            top_k=3,
        )
        tol = rounding_tol(torch.float32, 1, 3000, 64)
        torch.testing.assert_close(out[r : r + 1], want, rtol=tol, atol=tol)


def test_mask_function_accepts_cache_position_style_calls():
    # older transformers call the mask interface with cache_position instead of q_length / q_offset
    mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    assert moba_mask(batch_size=1, cache_position=torch.arange(5, 6), kv_length=6, attention_mask=mask).tolist() == [
        [False, True, True, True, True, True]
    ]
    assert moba_mask(batch_size=1, cache_position=torch.arange(5, 6), kv_length=6) is None
    static = moba_mask(batch_size=1, cache_position=torch.arange(5, 6), kv_length=8)  # a pre-allocated cache
    assert static.dtype == torch.int8 and static.tolist() == [[[[2, 2, 2, 2, 2, 2, 0, 0]]]]  # 6 slots written


def test_cached_decoding_under_autograd_equals_no_grad_and_the_full_forward(monkeypatch):
    """decode = "moba" with autograd on (a manual decode loop without torch.no_grad, or a model trained through
    its cached steps): every step gives the no-grad loop's logits and the full forward's, and the gradients of the
    last step's logits are the full forward's (the gate selects without a gradient, on both paths)."""
    spy = Spy(monkeypatch)
    torch.manual_seed(0)
    model = tiny_model("llama", GREEDY)
    ids = torch.randint(0, 97, (1, 10))
    steps = torch.randint(0, 97, (1, 8))  # caches of 11 .. 18 tokens: 3 .. 5 blocks, top_k = 2 of them

    def decode_loop():
        out = model(ids, use_cache=True)
        logits = []
        for i in range(steps.shape[1]):
            out = model(steps[:, i : i + 1], past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[:, -1])
        return torch.stack(logits, dim=1)

    with torch.no_grad():
        want = decode_loop()
    got = decode_loop()
    assert got.requires_grad
    assert spy.decodes == 2 * steps.shape[1] * model.config.num_hidden_layers  # every step sparse, both loops
    torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)  # the same operations on the same values
    full = model(torch.cat([ids, steps], dim=1)).logits[:, ids.shape[1] :]
    torch.testing.assert_close(got.detach(), full.detach(), rtol=0, atol=MODEL_TOL)
    params = [p for p in model.parameters() if p.requires_grad]
    cached_grads = torch.autograd.grad(got[:, -1].sum(), params)
    full_grads = torch.autograd.grad(full[:, -1].sum(), params)
    for cached, whole in zip(cached_grads, full_grads, strict=True):
        torch.testing.assert_close(cached, whole, rtol=0, atol=MODEL_TOL * max(1.0, float(whole.abs().max())))
    assert any(float(g.abs().max()) > 0 for g in cached_grads[:-1])
