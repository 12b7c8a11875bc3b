"""pytest set-up of the SGLang plugin tests: they run in the SGLang virtualenv (make test-sglang), with the plugin
installed under its entry point. Their helpers are in servers.py and, shared with tests_vllm,
tests/server_helpers.py; stand_ins/ holds the two modules SGLang imports that have no CPU build (see
stand_ins/README)."""

from __future__ import annotations

import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="the SGLang plugin tests run in the SGLang virtualenv (make test-sglang)")
sys.path.insert(0, str(Path(__file__).resolve().parent / "stand_ins"))


def pytest_collection_modifyitems(config, items):
    plugins = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    if plugins.get("moba_hf") != "moba_hf.sglang:register":
        pytest.exit(
            "moba_hf is not installed with its sglang.srt.plugins entry point (moba_hf = moba_hf.sglang:register): "
            "reinstall it with pip install --no-deps -e .",
            returncode=1,
        )
