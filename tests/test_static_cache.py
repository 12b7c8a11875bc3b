"""MoBA with transformers' pre-allocated `StaticCache`: prefill and decode steps read the written slots only,
the pooled keys are allocated for the whole cache at once, and greedy decoding equals the dynamic-cache path and the
full forward (decode "moba" / "full", dense tail, top_p, DCA, left padding, a cache used again for a new prompt)."""

import pytest
import torch
from kernel_cases import model_tol
from test_decode import CACHE, Spy, _full_forward
from tiny_models import TINY, tiny_model
from transformers import DynamicCache, StaticCache

from moba_hf import DcaConfig, MobaConfig
from moba_hf.integration import cache as moba_cache

PROMPT, NEW, CAPACITY = 13, 14, 40  # caches of 14 .. 27 tokens in 40 slots: 4 .. 7 blocks of 4
CASES = {
    "moba": MobaConfig(block_size=4, top_k=2),
    "full": MobaConfig(block_size=4, top_k=2, decode="full"),
    "dense_tail": MobaConfig(block_size=4, top_k=2, dense_tail=5),
    "top_p": MobaConfig(block_size=4, top_k=4, top_p=0.6, min_top_k=2),
    "dca": MobaConfig(block_size=4, top_k=2, dca=DcaConfig(chunk_size=12)),  # c = 16 (the model's), s = 12
}
# every decode step runs the sparse step over the static cache (the others: dense steps, or DCA's path)
SPARSE_STEPS = {"moba", "top_p"}
MODEL_TOL = model_tol(TINY, PROMPT + NEW)
# generate hands back float32 logits: one float32 rounding on top of the float64 model's
F32 = torch.finfo(torch.float32).eps


def _model(name: str):
    extra = {"max_position_embeddings": 16} if name == "dca" else {}
    return tiny_model("llama", CASES[name], pad_token_id=0, **extra)


def _prompt(padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 97, (2 if padded else 1, PROMPT))
    mask = torch.ones_like(ids)
    if padded:  # left padding: row 1 holds 8 real tokens
        ids[1, :5] = mask[1, :5] = 0
    return ids, mask


def _generate(model, ids, mask, **kwargs):
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
        return_dict_in_generate=True, output_logits=True, **kwargs,
    )  # fmt: skip
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("padded", [False, True], ids=["B1", "B2-left-padded"])
@pytest.mark.parametrize("name", CASES)
def test_static_cache_generates_as_the_dynamic_cache_and_the_full_forward(name, padded, one_thread, monkeypatch):
    model = _model(name)
    ids, mask = _prompt(padded)
    want, want_logits = _generate(model, ids, mask)
    spy = Spy(monkeypatch)
    got, logits = _generate(model, ids, mask, cache_implementation="static")
    assert torch.equal(got, want)
    scale = float(want_logits.abs().max())
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=MODEL_TOL + 2 * F32 * scale)
    if name in SPARSE_STEPS:
        layers = model.config.num_hidden_layers  # rows of other lengths too: one call over the written slots
        assert (spy.decodes, spy.builds) == ((NEW - 1) * layers, layers)  # sparse from the first step
    # each step's logits are the full forward's over its prefix (decode "full": the oracle takes rows unpadded)
    if name in ("moba", "top_p") or (name == "full" and not padded):
        seq = got[:, :-1]
        full_mask = torch.cat([mask, torch.ones(mask.shape[0], NEW - 1, dtype=mask.dtype)], dim=1)
        with torch.no_grad():
            if name == "full":
                full = _full_forward(model, seq, "full", PROMPT)
            else:
                full = model(seq, attention_mask=full_mask).logits
        full = full[:, PROMPT - 1 :]
        torch.testing.assert_close(logits.double(), full, rtol=0, atol=MODEL_TOL + F32 * float(full.abs().max()))
        assert torch.equal(full.argmax(-1), got[:, PROMPT:])


@pytest.mark.parametrize("padded", [False, True], ids=["B1", "B2-left-padded"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_float32_steps_take_the_native_step_and_equal_the_full_forward(kind, padded, monkeypatch):
    """A float32 model (where the native step runs, when built): rows of one length take it at every sparse step,
    its block update too; rows of other lengths the torch ops. Greedy tokens and logits equal the full forward's
    over each prefix, within float32 rounding."""
    from kernel_cases import rounding_tol

    from moba_hf.kernels import native

    model = tiny_model("llama", CASES["moba"], pad_token_id=0, dtype=torch.float32)
    ids, mask = _prompt(padded)
    calls = {"decode_step": 0, "block_append": 0}
    for name in calls:
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _r=real, _n=name: calls.update({_n: calls[_n] + 1}) or _r(*a))
    got, logits = _generate(model, ids, mask, **({} if kind == "dynamic" else {"cache_implementation": "static"}))
    layers = model.config.num_hidden_layers
    steps = (NEW - 1) * layers if native.available() and not padded else 0
    # the first sparse step builds each layer's block state from all its keys: later steps append one key
    assert calls == {"decode_step": steps, "block_append": max(0, steps - layers)}
    full_mask = torch.cat([mask, torch.ones(mask.shape[0], NEW - 1, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        full = model(got[:, :-1], attention_mask=full_mask).logits[:, PROMPT - 1 :]
    sizes = (PROMPT + NEW, TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"])
    tol = layers * rounding_tol(torch.float32, *sizes) * max(1.0, float(full.abs().max()))
    torch.testing.assert_close(logits, full, rtol=0, atol=tol)
    assert torch.equal(full.argmax(-1), got[:, PROMPT:])


@pytest.mark.parametrize("padded", [False, True], ids=["B1", "B2-left-padded"])
def test_static_sparse_steps_read_the_written_slots_in_place(padded, one_thread, monkeypatch):
    """On CPU in float64 a sparse step over a static cache is one in-place read of the written slots' prefix views
    (rows of one length: the one-query step; left-padded rows of other lengths: the general one), no window copied."""
    from moba_hf.kernels import decode as decode_kernels

    model = _model("moba")
    ids, mask = _prompt(padded)
    taken = []
    for name in ("_attend_in_place", "_attend_windows", "_one_query"):
        real = getattr(decode_kernels, name)
        monkeypatch.setattr(decode_kernels, name, lambda *a, _r=real, _n=name: taken.append(_n) or _r(*a))
    real_windows = moba_cache.StaticWindows.windows
    monkeypatch.setattr(
        moba_cache.StaticWindows, "windows", lambda *a: taken.append("StaticWindows") or real_windows(*a)
    )
    _generate(model, ids, mask, cache_implementation="static")
    steps = (NEW - 1) * model.config.num_hidden_layers
    assert taken == ["_attend_in_place" if padded else "_one_query"] * steps


@pytest.mark.parametrize("name", ["moba", "full"])
def test_unwritten_slots_are_never_read(name, one_thread):
    """Slots past the written ones hold NaN: every step's logits stay those of a cache of zeros (a key or value
    read there would make them NaN)."""
    model = _model(name)
    ids, mask = _prompt(padded=True)
    steps = torch.randint(1, 97, (2, 6))
    runs = []
    for poison in (False, True):
        cache = StaticCache(config=model.config, max_cache_len=CAPACITY)
        with torch.no_grad():
            out = [model(ids, attention_mask=mask, **{CACHE: cache}, use_cache=True).logits[:, -1]]
            if poison:
                for layer in cache.layers:
                    layer.keys[:, :, PROMPT:] = float("nan")
                    layer.values[:, :, PROMPT:] = float("nan")
            for t in range(steps.shape[1]):
                mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
                step = model(steps[:, t : t + 1], attention_mask=mask, **{CACHE: cache}, use_cache=True)
                out.append(step.logits[:, -1])
        mask = mask[:, :PROMPT]
        runs.append(torch.stack(out, dim=1))
    assert torch.isfinite(runs[1]).all()
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)


def test_block_state_is_allocated_once_for_the_whole_cache(one_thread):
    """The pooled keys are allocated for max_cache_len tokens at the first step: later steps write in place (the
    same storage), and the state is trusted step after step (kept by the count of tokens written)."""
    model = _model("moba")
    ids, _ = _prompt(padded=False)
    cache = StaticCache(config=model.config, max_cache_len=CAPACITY)
    with torch.no_grad():
        model(ids, **{CACHE: cache}, use_cache=True)
        model(torch.randint(1, 97, (1, 1)), **{CACHE: cache}, use_cache=True)
        states = moba_cache.layer_states(cache)
        pointers = {layer: s.pooled.data_ptr() for layer, s in states.items()}
        for _ in range(12):  # across three block boundaries
            model(torch.randint(1, 97, (1, 1)), **{CACHE: cache}, use_cache=True)
    blocks = moba_cache.layer_states(cache)
    assert len(states) == model.config.num_hidden_layers
    assert blocks == states  # the same objects: never rebuilt
    for layer, s in blocks.items():
        assert s.pooled.shape[2] == CAPACITY // 4 and s.pooled.data_ptr() == pointers[layer]
        assert s.n == PROMPT + 13


def test_a_reused_static_cache_rebuilds_for_a_new_prompt(one_thread, monkeypatch):
    """`generate` with cache_implementation="static" keeps one cache across calls (reset between them), and a
    cache passed in and reset by hand: each new prompt rebuilds the block state and decodes as a fresh cache."""
    model = _model("moba")
    spy = Spy(monkeypatch)
    prompts = [_prompt(padded=False) for _ in range(2)] + [(torch.randint(1, 97, (1, 9)), None)]
    for ids, mask in prompts:
        want = _generate(model, ids, mask)[0]
        spy.builds = 0
        assert torch.equal(_generate(model, ids, mask, cache_implementation="static")[0], want)
        assert spy.builds == model.config.num_hidden_layers
    cache = StaticCache(config=model.config, max_cache_len=CAPACITY)
    for ids, mask in prompts:
        cache.reset()
        want = _generate(model, ids, mask)[0]
        assert torch.equal(_generate(model, ids, mask, **{CACHE: cache})[0], want)


def test_static_and_dynamic_caches_step_alike_after_chunked_prefill(one_thread):
    """Prefill in chunks (more queries than a decode step takes, and a few) into a static cache: the logits of
    every chunk equal the dynamic cache's."""
    model = _model("moba")
    ids = torch.randint(1, 97, (2, 30))
    got, want = [], []
    for cache, out in ((StaticCache(config=model.config, max_cache_len=CAPACITY), got), (DynamicCache(), want)):
        t = 0
        with torch.no_grad():
            for chunk in (9, 3, 12, 1, 2, 1, 2):
                out.append(model(ids[:, t : t + chunk], **{CACHE: cache}, use_cache=True).logits)
                t += chunk
    torch.testing.assert_close(torch.cat(got, dim=1), torch.cat(want, dim=1), rtol=0, atol=MODEL_TOL)


def test_a_static_cache_too_small_is_refused():
    model = _model("moba")
    cache = StaticCache(config=model.config, max_cache_len=8)
    with pytest.raises(
        ValueError, match=r"need 13 keys; the cache holds 8 \(a pre-allocated cache: allocate a larger max_cache_len\)"
    ):
        model(torch.randint(1, 97, (1, PROMPT)), **{CACHE: cache}, use_cache=True)


def test_static_windows_read_the_windows_of_each_row():
    """`StaticWindows` reads width positions from each start, rows at `first`: the slices of the cache's tensors."""
    k, v = torch.randn(2, 3, 20, 4), torch.randn(2, 3, 20, 4)
    windows = moba_cache.StaticWindows(k, v, first=5, length=11)
    start = torch.tensor([[[0, 7], [3, 2], [6, 6]], [[1, 0], [7, 4], [5, 0]]])
    got_k, got_v = windows.windows(start, 4, torch.float64)
    assert windows.shape == (2, 3, 11, 4) and got_k.dtype == torch.float64
    for b in range(2):
        for h in range(3):
            for u in range(2):
                s = 5 + int(start[b, h, u])
                torch.testing.assert_close(got_k[b, h, 4 * u : 4 * u + 4], k[b, h, s : s + 4].double())
                torch.testing.assert_close(got_v[b, h, 4 * u : 4 * u + 4], v[b, h, s : s + 4].double())


@pytest.mark.slow
def test_smollm2_static_cache_generates_the_dynamic_caches_tokens():
    """The embedded SmolLM2, training-free gate with sparse decode steps: a prompt past the sink, local and gated
    blocks of 64, greedy tokens with a StaticCache equal the DynamicCache's."""
    from moba_hf.models import load

    model, tokenizer = load("smollm2", moba=MobaConfig.preset("training-free").replace(decode="moba"))
    text = "Here is a list of the planets of the solar system, in order from the sun: Mercury, Venus. " * 30
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :560]
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    want = model.generate(ids, **kwargs)
    assert torch.equal(model.generate(ids, cache_implementation="static", **kwargs), want)
