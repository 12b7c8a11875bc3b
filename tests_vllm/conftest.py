"""pytest set-up of the vLLM plugin tests: they run in the vLLM virtualenv (make test-vllm), with the plugin
installed under its entry point. Their helpers are in engines.py and, shared with tests_sglang,
tests/server_helpers.py."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm", reason="the vLLM plugin tests run in the vLLM virtualenv (make test-vllm)")


def pytest_collection_modifyitems(config, items):
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    if plugins.get("moba_hf") != "moba_hf.vllm:register":
        pytest.exit(
            "moba_hf is not installed with its vllm.general_plugins entry point (moba_hf = "
            "moba_hf.vllm:register): reinstall it with pip install --no-deps -e .",
            returncode=1,
        )
