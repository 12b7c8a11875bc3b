"""The stand-ins for sgl_kernel and torchvision (stand_ins/README): the torch version of the one name SGLang
calls, and a server run reading exactly the names they serve (slow: one server)."""

from __future__ import annotations

import json

import pytest
import sgl_kernel  # the stand-in (conftest puts stand_ins/ first on sys.path)
import torch
from server_helpers import free_port, prompt_ids
from servers import STAND_INS, generate, launch_command, server, server_env


def served_names() -> set[str]:
    """module.name for every name a stand-in module serves."""
    import importlib

    found = set()
    for path in sorted(STAND_INS.rglob("*.py")):
        parts = path.relative_to(STAND_INS).with_suffix("").parts
        if parts[0] == "stand_in":
            continue
        module_name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        module = importlib.import_module(module_name)
        found |= {f"{module_name}.{name}" for name in module.__getattr__.served}
    return found


def test_assign_req_to_token_pool_cpu_writes_each_requests_run():
    req_to_token = torch.full((4, 10), -1, dtype=torch.int32)
    out_cache_loc = torch.arange(100, 107, dtype=torch.int64)
    rows, starts, ends = torch.tensor([2, 0]), torch.tensor([3, 0]), torch.tensor([7, 3])
    sgl_kernel.assign_req_to_token_pool_cpu(rows, req_to_token, starts, ends, out_cache_loc, 10)
    assert req_to_token[2, 3:7].tolist() == [100, 101, 102, 103]
    assert req_to_token[0, 0:3].tolist() == [104, 105, 106]
    assert (
        (req_to_token[[1, 3]] == -1).all() and (req_to_token[2, :3] == -1).all() and (req_to_token[2, 7:] == -1).all()
    )


def test_stand_ins_refuse_other_names():
    with pytest.raises(AttributeError, match="stand-in sgl_kernel has no 'silu_and_mul'"):
        sgl_kernel.silu_and_mul  # noqa: B018
    with pytest.raises(ImportError):
        from sgl_kernel import silu_and_mul  # noqa: F401
    with pytest.raises(NotImplementedError, match="computes nothing"):
        sgl_kernel.verify_tree_greedy_cpu()


@pytest.mark.slow
def test_a_server_reads_exactly_the_served_names(tmp_path):
    log = tmp_path / "names.log"
    port = free_port()
    args = ["--attention-backend", "moba", "--json-model-override-args", json.dumps({"moba_config": {"top_k": 2}})]
    with server(launch_command(*args, port=port), server_env(log_names=log), tmp_path / "server.log", port) as base:
        assert len(generate(base, prompt_ids(300, 1), 4, ignore_eos=True)["tokens"]) == 4  # prefill and decode
    read = set(log.read_text().split())
    assert read <= served_names()  # by construction: any other name fails the import
    assert served_names() - read == set(), "stand-in names SGLang no longer reads: remove them"
