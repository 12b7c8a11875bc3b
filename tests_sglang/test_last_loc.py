"""SGLang's `get_last_loc` under the plugin: its Triton kernel runs for every backend not named torch_native or
ascend (so for "moba"), and needs a GPU; the plugin answers CPU tensors with SGLang's torch version. Paged pools
(page size > 1) call it for every extend."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # as the servers run: SGLang's CPU paths on import
import moba_hf.sglang as plugin  # noqa: E402


def test_cpu_tensors_take_the_torch_version_with_the_kernels_answer():
    def triton_kernel(*args, **kwargs):
        raise AssertionError("the Triton kernel ran on CPU tensors")

    req_to_token = torch.arange(40, dtype=torch.int32).view(4, 10)
    rows = torch.tensor([2, 0, 3])
    prefix_lens = torch.tensor([3, 0, 10])
    got = plugin.last_loc(triton_kernel, req_to_token, rows, prefix_lens)
    # the slot of each request's last prefix token, -1 without a prefix
    assert got.tolist() == [22, -1, 39]


def test_other_devices_keep_sglangs_own_function():
    calls = []
    req_to_token = torch.empty(4, 10, dtype=torch.int32, device="meta")
    plugin.last_loc(lambda *args: calls.append(args) or "kernel", req_to_token, "rows", "lens")
    assert calls == [(req_to_token, "rows", "lens")]
