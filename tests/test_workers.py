"""The single-threaded CPU workers that run MoBA's query ranges."""

from __future__ import annotations

import threading

import pytest
import torch

from moba_hf.kernels import workers


def _where() -> tuple[str, int, bool]:
    return threading.current_thread().name, torch.get_num_threads(), torch.is_grad_enabled()


def test_parts_run_on_single_threaded_workers_and_the_caller_keeps_its_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            seen = workers.run_all([_where, _where, _where], 3)
        assert [name for name, _, _ in seen] == ["moba-worker"] * 3
        assert [threads for _, threads, _ in seen] == [1, 1, 1]
        assert not any(grad for _, _, grad in seen)  # the caller's autograd mode holds in the parts
        assert torch.get_num_threads() == 2
        # a thread started afterwards gets PyTorch's default again, not the workers' single thread
        found = []
        thread = threading.Thread(target=lambda: found.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert found == [2]
    finally:
        torch.set_num_threads(before)


def test_results_keep_order_and_one_part_or_worker_runs_inline():
    assert workers.run_all([lambda i=i: i * i for i in range(5)], 5) == [0, 1, 4, 9, 16]
    me = threading.current_thread().name
    assert workers.run_all([_where], 4)[0][0] == me
    assert [name for name, _, _ in workers.run_all([_where, _where], 1)] == [me, me]


def test_nested_parts_run_inline_on_the_worker():
    inner = workers.run_all([lambda: workers.worker_count(torch.device("cpu"))] * 2, 2)
    assert inner == [1, 1]
    assert workers.worker_count(torch.device("meta")) == 1


def test_an_error_in_a_part_reaches_the_caller_after_every_part_finished():
    finished = []

    def slow():
        threading.Event().wait(0.2)
        finished.append(True)

    def fail():
        raise ValueError("part failed")

    with pytest.raises(ValueError, match="part failed"):
        workers.run_all([fail, slow], 2)
    assert finished == [True]
