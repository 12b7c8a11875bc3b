"""`moba-hf demo`'s default work stays bounded: one 8K prompt per attention, so it answers in minutes on 2 cores."""

import pytest

from moba_hf import cli, demo

pytestmark = pytest.mark.usefixtures("one_thread")

# Two prefills of one prompt inside SmolLM2's 8192-token window: about 1 minute of the demo on an idle 2-core
# CPU (docs/results.md, "The demo"). Each prompt token more costs sdpa's quadratic prefill twice.
PREFILL_BUDGET = 2 * 8192
DECODE_BUDGET = 2 * 8


def test_the_default_demo_prefills_one_8k_prompt_per_attention(tiny_dir, monkeypatch, capsys):
    import moba_hf.eval.passkey as passkey
    from moba_hf import models

    load = models.load_model

    def load_tiny(name, **kwargs):
        model, tokenizer = load(str(tiny_dir), **kwargs)
        model.config.max_position_embeddings = 8192  # SmolLM2's window, so the default lengths pass its check
        return model, tokenizer

    calls = []

    def trial(model, tokenizer, length, depth, key, max_new_tokens=8):
        moba = model.config._attn_implementation == "moba"
        calls.append((length, max_new_tokens, "moba" if moba else "sdpa"))
        return passkey.PasskeyTrial(length, depth, key, key, True, length - 16, 2.0 if moba else 3.0,
                                    f"{key}. Remember", 0.8 if moba else 0.0)  # fmt: skip

    monkeypatch.setattr(models, "load_model", load_tiny)
    monkeypatch.setattr(passkey, "run_trial", trial)
    assert cli.main(["demo"]) == 0
    assert calls == [(8000, 8, "sdpa"), (8000, 8, "moba")]
    assert sum(length for length, _, _ in calls) <= PREFILL_BUDGET and demo.WARMUP_TOKENS <= 128
    assert sum(new for _, new, _ in calls) <= DECODE_BUDGET
    out = capsys.readouterr().out
    assert "MoBA: MobaConfig(block_size=64" in out and "(setting training-free)" in out
    # the answer table: each attention's answer to the same passkey, then the speed-up with its direction
    assert "| sdpa (dense) | `" in out and "| MoBA training-free | `" in out
    assert "| moba speed-up (higher = faster) |" in out and "| 1.50x | 0.80 |" in out
    assert "higher = MoBA faster" in out
    assert f"Longer runs: {demo.LONGER_RUN}." in out
