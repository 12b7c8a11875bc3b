"""torch.compile with MoBA (CPU, inductor): a compiled model prefills several lengths and decodes with the eager
model's results, for the torch backend, a dense tail, padding and decode = "moba" / "full".

`model.compile()` compiles the module in place, so `generate` runs the compiled forward. Over a growing cache the
attention call and the cache hook run eagerly inside it (graph breaks); a step over a StaticCache is one graph that
calls the attention as a custom op (see the README's "torch.compile").
"""

import copy

import pytest
import torch
from kernel_cases import rounding_tol
from test_decode import CACHE, Spy
from tiny_models import TINY, tiny_model

from moba_hf import DcaConfig, MobaConfig

pytestmark = pytest.mark.slow

CASES = {
    "moba": MobaConfig(block_size=4, top_k=2),
    "dense_tail": MobaConfig(block_size=4, top_k=2, dense_tail=5),
    "decode_full": MobaConfig(block_size=4, top_k=2, decode="full"),
}
# transformers computes RoPE's cos / sin in float32 (eager and compiled alike) and inductor's vectorized cos / sin
# round differently from eager's: the float64 model then differs at float32 rounding, per layer and reduction
SIZES = (41, TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"])
TOL = TINY["num_hidden_layers"] * rounding_tol(torch.float32, *SIZES)
NEW = 10


def _left_padded(lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :], mask[row, width - n :] = torch.randint(1, 97, (n,)), 1
    return ids, mask


def _generate(model, ids, mask):
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
    )


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


@pytest.mark.parametrize("name", CASES)
def test_compiled_model_prefills_several_lengths_and_generates_as_eager(name, one_thread, monkeypatch):
    torch._dynamo.reset()
    eager = tiny_model("llama", CASES[name], pad_token_id=0)
    model = copy.deepcopy(eager)
    model.compile()
    calls = Spy(monkeypatch)
    with torch.no_grad():
        for n in (20, 27, 33):  # past the second length the shapes are dynamic
            ids = torch.randint(0, 97, (1, n))
            torch.testing.assert_close(model(ids).logits, eager(ids).logits, rtol=0, atol=TOL)
    for lengths in ((13, 20), (1, 24)):  # left padding; a one-token prompt
        ids, mask = _left_padded(lengths)
        calls.decodes = calls.builds = 0
        got = _generate(model, ids, mask)
        sparse, builds = calls.decodes, calls.builds
        assert torch.equal(got, _generate(eager, ids, mask))
        assert (sparse, builds) == (calls.decodes - sparse, calls.builds - builds)  # compiled steps: eager's path
        if name != "decode_full":  # every step after the first block sparse, the block state built once a layer
            assert sparse > 0 and builds == TINY["num_hidden_layers"]
    # bounded: once warm, another prompt length and another padded batch compile nothing new
    graphs = _graphs()
    with torch.no_grad():
        ids = torch.randint(0, 97, (1, 41))
        torch.testing.assert_close(model(ids).logits, eager(ids).logits, rtol=0, atol=TOL)
    ids, mask = _left_padded((9, 17))
    assert torch.equal(_generate(model, ids, mask), _generate(eager, ids, mask))
    assert _graphs() == graphs


def test_compiled_smollm2_training_free_generates_as_eager():
    """The embedded SmolLM2 with the training-free preset, compiled: two prompt lengths (sparse prefills past the
    preset's sink, local and 5 gated blocks of 64) generate eager's tokens, in one process."""
    from moba_hf.models import load

    torch._dynamo.reset()
    model, tokenizer = load("smollm2", moba="training-free")
    text = "Here is a list of the planets of the solar system, in order from the sun: Mercury, Venus. " * 40
    ids = tokenizer(text, return_tensors="pt").input_ids
    prompts = [ids[:, :520], ids[:, :600]]
    want = [model.generate(p, max_new_tokens=6, do_sample=False) for p in prompts]
    model.compile()
    graphs = _graphs()
    for prompt, tokens in zip(prompts, want, strict=True):
        assert torch.equal(model.generate(prompt, max_new_tokens=6, do_sample=False), tokens)
    assert _graphs() > graphs  # generate ran the compiled forward


def _greedy_steps(cache, prefill, step, ids, steps: int) -> torch.Tensor:
    """The prompt `ids` [1, N] through `prefill` into `cache`, then `steps` greedy one-token steps through `step`:
    the tokens [1, steps + 1]."""
    with torch.no_grad():
        tokens = [prefill(ids, **{CACHE: cache}, use_cache=True).logits[:, -1:].argmax(-1)]
        for t in range(steps):
            position = torch.tensor([[ids.shape[1] + t]])
            out = step(input_ids=tokens[-1], position_ids=position, **{CACHE: cache}, use_cache=True)
            tokens.append(out.logits[:, -1:].argmax(-1))
    return torch.cat(tokens, dim=1)


def _static_decode(step, model, ids, mask, steps: int, warm: int):
    """Prefill `ids` eagerly into a StaticCache, then `steps` greedy steps through `step` (the model or its compiled
    forward), each with fixed-shape inputs: the next token, its positions and a mask of all the cache's slots. After
    `warm` steps a recompile raises. Returns the tokens [B, steps + 1] and every step's logits."""
    from transformers import StaticCache

    capacity = ids.shape[1] + steps
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    full = torch.zeros(ids.shape[0], capacity, dtype=torch.long, device=ids.device)
    full[:, : ids.shape[1]] = mask
    with torch.no_grad():
        out = model(ids, attention_mask=mask, cache=cache, use_cache=True)
        tokens, logits = [out.logits[:, -1:].argmax(-1)], [out.logits[:, -1]]
        position = mask.sum(-1, keepdim=True)
        for t in range(steps):
            full[:, ids.shape[1] + t] = 1
            with torch._dynamo.config.patch(error_on_recompile=t >= warm):
                out = step(
                    input_ids=tokens[-1], attention_mask=full, position_ids=position, cache=cache, use_cache=True
                )
            position = position + 1
            tokens.append(out.logits[:, -1:].argmax(-1))
            logits.append(out.logits[:, -1])
    return torch.cat(tokens, dim=1), torch.stack(logits, dim=1)


# DCA moves each step's fresh keys in the cache: over a StaticCache, inside the op (c = 16, the model's window)
STATIC_CASES = {**CASES, "dca": MobaConfig(block_size=4, top_k=2, dca=DcaConfig(chunk_size=12))}


@pytest.mark.parametrize("name", ["moba", "decode_full", "dca"])
def test_compiled_static_cache_decode_compiles_once_and_equals_eager(name, one_thread, monkeypatch):
    """torch.compile of the decode step over a StaticCache (a left-padded batch): every input keeps its shape from
    step to step (the cache's length is a tensor, the mask covers every slot), so after the first step nothing
    compiles again, across block boundaries; the step is one graph (no break: the attention is a custom op); the
    tokens are eager's and the logits within float32 rounding."""
    torch._dynamo.reset()
    extra = {"max_position_embeddings": 16} if name == "dca" else {}
    model = tiny_model("llama", STATIC_CASES[name], pad_token_id=0, **extra)
    ids, mask = _left_padded((13, 8))
    want, want_logits = _static_decode(model, model, ids, mask, steps=14, warm=14)
    calls = Spy(monkeypatch)
    graphs, breaks = _graphs(), _graph_breaks()
    got, logits = _static_decode(torch.compile(model), model, ids, mask, steps=14, warm=1)
    assert _graphs() == graphs + 1 and _graph_breaks() == breaks  # one graph for every step
    assert torch.equal(got, want)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=TOL)
    if name == "moba":  # every compiled step took the sparse step, once per layer (rows of two lengths together)
        assert calls.decodes == 14 * TINY["num_hidden_layers"] and calls.builds == TINY["num_hidden_layers"]


CAPTURED_CASES = {
    **STATIC_CASES,
    "sink_local": MobaConfig(block_size=4, top_k=3, sink_blocks=1, local_blocks=1, pooling="bound"),
    "top_p": MobaConfig(block_size=4, top_k=3, top_p=0.7),
    "hybrid": MobaConfig(block_size=4, top_k=2, full_attn_layers=1),
}


@pytest.mark.parametrize("name", ["moba", "decode_full", "sink_local", "top_p", "hybrid", "dca"])
def test_captured_static_decode_runs_device_ops_only_and_equals_eager(name, one_thread, monkeypatch):
    """Where compiled steps are captured (CUDA; here forced on the CPU), a one-token step over a StaticCache runs
    `kernels.graph_step` in the graph, no `moba_hf::attention` op (whose body reads the host): after the step that
    builds the block state, no attention call runs eager code and nothing compiles again. DCA keeps the op (its
    remapping reads positions on the host). Tokens equal eager's, logits within float32 rounding."""
    from moba_hf.integration import attention as moba_attention
    from moba_hf.integration import cache as moba_cache

    torch._dynamo.reset()
    extra = {"max_position_embeddings": 16} if name == "dca" else {}
    model = tiny_model("llama", CAPTURED_CASES[name], pad_token_id=0, **extra)
    ids, mask = _left_padded((13, 8))
    want, want_logits = _static_decode(model, model, ids, mask, steps=14, warm=14)
    monkeypatch.setattr(moba_cache, "GRAPH_STEP_DEVICES", frozenset({"cpu"}))
    eager_calls = []
    real_eager = moba_attention._eager_forward
    monkeypatch.setattr(moba_attention, "_eager_forward", lambda *a: eager_calls.append(1) or real_eager(*a))
    graphs, breaks = _graphs(), _graph_breaks()
    steps_seen = []

    def step(**kwargs):
        steps_seen.append(len(eager_calls))
        return compiled(**kwargs)

    compiled = torch.compile(model)
    got, logits = _static_decode(step, model, ids, mask, steps=14, warm=1)
    assert torch.equal(got, want)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=TOL)
    assert _graph_breaks() == breaks and _graphs() == graphs + 1
    op_calls = len(eager_calls) - steps_seen[0]  # attention calls that ran eager code during the steps
    assert op_calls == (14 * TINY["num_hidden_layers"] if name == "dca" else 0)


def test_captured_steps_follow_a_cache_prefilled_again_and_refuse_one_refilled_by_other_code(one_thread, monkeypatch):
    """The block statistics a captured step reads live on the cache's keys tensor and count the slots they cover. A
    StaticCache reset and prefilled again by the model is read afresh (the prompt rebuilds them, in the same tensor);
    one refilled by other code (here the same weights under SDPA) leaves them behind its slots, and the captured
    step stops with an error instead of attending by the old blocks."""
    from transformers import StaticCache

    import moba_hf
    from moba_hf.integration import cache as moba_cache

    torch._dynamo.reset()
    sdpa = tiny_model("llama")
    model = moba_hf.apply(copy.deepcopy(sdpa), CASES["moba"])
    monkeypatch.setattr(moba_cache, "GRAPH_STEP_DEVICES", frozenset({"cpu"}))
    compiled = torch.compile(model)
    cache = StaticCache(config=model.config, max_cache_len=40)

    def run(prefill, step, ids):
        cache.reset()
        return _greedy_steps(cache, prefill, step, ids, steps=6)

    for n in (19, 11):  # the second prompt is shorter: the statistics of the first must not survive it
        ids = torch.randint(1, 97, (1, n))
        want = run(model, model, ids)
        assert torch.equal(run(model, compiled, ids), want)
    with pytest.raises(RuntimeError, match="block statistics behind or ahead of the cache"):
        run(sdpa, compiled, torch.randint(1, 97, (1, 15)))


def test_a_step_under_a_sparsity_tracker_is_counted_and_the_next_ones_are_captured_again(one_thread, monkeypatch):
    """`track_sparsity` counts on the host: while one is open (in any thread) a compiled step takes the op and is
    counted, per layer and as a decode step; once it closes the steps are captured again (no eager call)."""
    from transformers import StaticCache

    import moba_hf
    from moba_hf.integration import attention as moba_attention
    from moba_hf.integration import cache as moba_cache

    torch._dynamo.reset()
    monkeypatch.setattr(moba_cache, "GRAPH_STEP_DEVICES", frozenset({"cpu"}))
    model = tiny_model("llama", CASES["moba"])
    compiled = torch.compile(model)
    eager_calls = []
    real_eager = moba_attention._eager_forward
    monkeypatch.setattr(moba_attention, "_eager_forward", lambda *a: eager_calls.append(1) or real_eager(*a))
    cache = StaticCache(config=model.config, max_cache_len=40)
    ids = torch.randint(1, 97, (1, 21))
    with torch.no_grad():
        token = model(ids, **{CACHE: cache}, use_cache=True).logits[:, -1:].argmax(-1)

        def step(t):
            out = compiled(input_ids=token, position_ids=torch.tensor([[21 + t]]), **{CACHE: cache}, use_cache=True)
            return out.logits[:, -1:].argmax(-1)

        token = step(0)
        before = len(eager_calls)
        with moba_hf.track_sparsity() as stats:
            token = step(1)
        assert len(eager_calls) == before + TINY["num_hidden_layers"]
        assert set(stats.per_layer()) == set(range(TINY["num_hidden_layers"]))
        assert all(0 < s < 1 for s in stats.per_layer().values())  # block 4 / top 2 of 6 blocks: sparse
        for t in (2, 3):
            token = step(t)
    assert len(eager_calls) == before + TINY["num_hidden_layers"]


def test_captured_steps_follow_a_new_moba_config(one_thread, monkeypatch):
    """The plan a captured step attends by is worked out when the step is traced; assigning the model a new
    moba_config traces the step again, so the steps after it attend by the new settings, as eager steps do."""
    from transformers import StaticCache

    from moba_hf.integration import cache as moba_cache

    torch._dynamo.reset()
    monkeypatch.setattr(moba_cache, "GRAPH_STEP_DEVICES", frozenset({"cpu"}))
    eager = tiny_model("llama", MobaConfig(block_size=4, top_k=3))
    model = copy.deepcopy(eager)
    compiled = torch.compile(model)
    ids = torch.randint(1, 97, (1, 23))

    def run(target, step):
        cache = StaticCache(config=target.config, max_cache_len=40)
        with torch.no_grad():
            logits = [target(ids, **{CACHE: cache}, use_cache=True).logits[:, -1]]
            for t in range(8):
                if t == 4:  # own block only from here
                    target.config.moba_config = MobaConfig(block_size=4, top_k=1).to_dict()
                token = logits[-1].argmax(-1, keepdim=True)
                out = step(input_ids=token, position_ids=torch.tensor([[23 + t]]), **{CACHE: cache}, use_cache=True)
                logits.append(out.logits[:, -1])
        return torch.stack(logits)

    torch.testing.assert_close(run(model, compiled), run(eager, eager), rtol=0, atol=TOL)


def test_compiled_steps_over_a_cache_filled_elsewhere_keep_the_block_state_beside_its_keys(one_thread, monkeypatch):
    """A loop's first compiled call may be a decode step over a StaticCache no eager moba call has seen (here filled
    by the same weights under SDPA): no hook runs in the graph, and the attention op finds each layer's block state
    by the layer's keys tensor: built at the first step, appended to at every later one, in one graph without a
    break. The tokens are those of eager steps over a cache filled alike."""
    from transformers import StaticCache

    import moba_hf

    torch._dynamo.reset()
    sdpa = tiny_model("llama")
    model = moba_hf.apply(copy.deepcopy(sdpa), CASES["moba"])
    ids, steps = torch.randint(1, 97, (1, 19)), 9

    def run(step):
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps)
        return _greedy_steps(cache, sdpa, step, ids, steps)

    want = run(model)
    calls = Spy(monkeypatch)
    breaks = _graph_breaks()
    got = run(torch.compile(model))
    assert torch.equal(got, want)
    assert _graph_breaks() == breaks
    layers = model.config.num_hidden_layers
    assert (calls.decodes, calls.builds) == (steps * layers, layers)


def test_compiled_generate_with_a_static_cache_runs_one_graph_per_step(one_thread, monkeypatch):
    """`model.compile()` then `generate(..., cache_implementation="static")`, a left-padded batch: the prefill and
    every step run compiled without a graph break (the attention is the custom op), the block state is built at the
    prefill and appended to after, and the tokens are eager's."""
    torch._dynamo.reset()
    eager = tiny_model("llama", CASES["moba"], pad_token_id=0)
    model = copy.deepcopy(eager)
    model.compile()
    ids, mask = _left_padded((13, 8))

    def generate(m):
        kwargs = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        return m.generate(ids, attention_mask=mask, cache_implementation="static", **kwargs)

    want = generate(eager)
    calls = Spy(monkeypatch)
    graphs, breaks = _graphs(), _graph_breaks()
    got = generate(model)
    assert torch.equal(got, want)
    assert _graphs() > graphs and _graph_breaks() == breaks
    layers = TINY["num_hidden_layers"]
    assert (calls.decodes, calls.builds) == ((NEW - 1) * layers, layers)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["moba", "decode_full"])
def test_cuda_graph_steps_are_captured_and_equal_eager(name):
    """On a GPU, `mode="reduce-overhead"`: every one-token step over a StaticCache is captured as a CUDA graph
    (inductor skips none) and the tokens are eager's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model("llama", CASES[name], pad_token_id=0).cuda()
    ids, mask = _left_padded((13, 8))
    ids, mask = ids.cuda(), mask.cuda()
    want, _ = _static_decode(model, model, ids, mask, steps=12, warm=12)
    got, _ = _static_decode(torch.compile(model, mode="reduce-overhead"), model, ids, mask, steps=12, warm=1)
    assert torch.equal(got, want)
    assert not {key: n for key, n in counters["inductor"].items() if "cudagraph_skip" in key}
