"""Models used from several threads at once: what a forward computes follows from its own model and inputs.

Each test first computes every answer alone, then runs the same calls from two threads with a narrow switch
interval (so the interpreter switches threads inside the attention function's Python code) and compares
bit for bit: a forward that read the other thread's config, cache or tracker would differ.
"""

import sys
import threading
import time

import pytest
import torch
from tiny_models import tiny_model

import moba_hf
from moba_hf import MobaConfig

N = 24
# two configs per model; each forward switches its model to the other one, so every layer resolves its config
# again on every forward (the moment a shared resolution could be read across threads)
CONFIGS = {
    "a": (MobaConfig(block_size=4, top_k=1), MobaConfig(block_size=4, top_k=2)),
    "b": (MobaConfig(block_size=8, top_k=1), MobaConfig(block_size=6, top_k=2)),
}


class SlowToCompare:
    """A config value whose == lets other threads run (as any value with a Python-level __eq__ may): the
    attention function compares the config with what it resolved, so this widens every window in which a shared
    resolution could change hands."""

    def __eq__(self, other):
        time.sleep(1e-4)
        return isinstance(other, SlowToCompare)

    __hash__ = None


@pytest.fixture
def narrow_switches(one_thread):
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def _run_in_threads(*jobs):
    errors = []

    def guarded(job):
        try:
            job()
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _switching_logits(model, configs, ids, rounds):
    """Logits of `rounds` forwards, switching `model` between `configs` before each."""
    out = []
    with torch.no_grad():
        for i in range(rounds):
            moba_hf.apply(model, configs[i % len(configs)])
            out.append(model(ids).logits)
    return out


def test_two_models_with_different_configs_in_two_threads_never_cross(narrow_switches):
    torch.manual_seed(0)
    models = {name: tiny_model("llama") for name in CONFIGS}
    for model in models.values():
        model.config.slow_to_compare = SlowToCompare()
    ids = {name: torch.randint(0, 97, (1, N)) for name in CONFIGS}
    alone = {name: _switching_logits(models[name], CONFIGS[name], ids[name], 2) for name in CONFIGS}
    for name in CONFIGS:  # each config gives its own answer, so a forward run with another one is seen
        assert not torch.equal(alone[name][0], alone[name][1])
        other = next(o for o in CONFIGS if o != name)
        for config in CONFIGS[other]:
            with torch.no_grad():
                moba_hf.apply(models[name], config)
                assert not any(torch.equal(models[name](ids[name]).logits, want) for want in alone[name])

    rounds = 300
    results = {}

    def job(name):
        def run():
            results[name] = _switching_logits(models[name], CONFIGS[name], ids[name], rounds)

        return run

    _run_in_threads(job("a"), job("b"))
    for name in CONFIGS:
        wrong = [i for i, got in enumerate(results[name]) if not torch.equal(got, alone[name][i % 2])]
        assert not wrong, f"model {name}: {len(wrong)} of {rounds} forwards differ from the same forward alone"


def test_track_sparsity_counts_only_its_own_threads_forwards(narrow_switches):
    torch.manual_seed(0)
    tracked = tiny_model("llama", MobaConfig(block_size=4, top_k=1), layers=2)
    other = tiny_model("llama", MobaConfig(block_size=4, top_k=3), layers=4)
    ids = torch.randint(0, 97, (1, N))
    with torch.no_grad(), moba_hf.track_sparsity() as want:
        for _ in range(20):
            tracked(ids)

    other_running = threading.Event()
    done = threading.Event()

    def busy():
        with torch.no_grad():
            while not done.is_set():
                with moba_hf.track_sparsity():  # a tracker of its own, open all the while
                    other(ids)
                other_running.set()

    def measured():
        other_running.wait()
        try:
            with torch.no_grad(), moba_hf.track_sparsity() as got:
                for _ in range(20):
                    tracked(ids)
            measured.stats = got
        finally:
            done.set()

    _run_in_threads(busy, measured)
    got = measured.stats
    assert sorted(got.layers) == [0, 1]
    assert got.per_layer() == want.per_layer() and got.overall == want.overall


def _greedy(model, ids, steps):
    """Greedy tokens of a manual cached decoding loop (DynamicCache, one new token a step)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    tokens = []
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True).logits
        for _ in range(steps):
            token = logits[:, -1:].argmax(-1)
            tokens.append(int(token))
            logits = model(token, past_key_values=cache, use_cache=True).logits
    return tokens


def test_one_model_decoding_two_prompts_in_two_threads_reads_each_threads_cache(narrow_switches):
    """Sparse decoding keeps block state beside each cache; the layer's hooks find the cache of the call in
    progress, per thread."""
    torch.manual_seed(0)
    model = tiny_model("llama", MobaConfig(block_size=4, top_k=2, decode="moba"))
    prompts = [torch.randint(0, 97, (1, n)) for n in (21, 30)]
    steps = 24
    alone = [_greedy(model, ids, steps) for ids in prompts]
    assert alone[0] != alone[1]
    results = [None, None]

    def job(i):
        def run():
            results[i] = [_greedy(model, prompts[i], steps) for _ in range(3)]

        return run

    _run_in_threads(job(0), job(1))
    assert results == [[tokens] * 3 for tokens in alone]
