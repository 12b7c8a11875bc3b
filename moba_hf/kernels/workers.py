"""Independent pieces of CPU work on single-threaded workers.

A PyTorch CPU op splits itself statically over the intra-op threads and waits for all of them at the end. MoBA's
forward is thousands of such ops (gathers, merges, small attention calls): with another CPU-bound process on
the machine, each op waits for whichever thread the scheduler has put to sleep, and a 5x kernel becomes slower
than dense attention. Here the work is cut instead into independent parts (query ranges), each run start to
end by one worker thread whose ops are single-threaded: a slowed worker delays only its own part, and the short
ops of one part overlap the long ones of another::

    caller (N intra-op threads)      worker 1 (1 thread): part 1 ... part N+1 ...
        run_all(parts)  -- waits --  worker 2 (1 thread): part 2 ...
                                     ...  worker N

PyTorch ops release the GIL, so the workers run in parallel. The number of workers follows the caller's
`torch.get_num_threads()`; nested calls, a single thread, or a build whose thread setting is not per thread
(checked once) run the parts inline, in order.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")

_local = threading.local()  # .worker: this thread is one of ours


class _Pool:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.per_thread_setting: bool | None = None  # can a worker be single-threaded alone?

    def _work(self, started: threading.Event, restored: threading.Event, checked: threading.Event, seen: list) -> None:
        _local.worker = True
        torch.get_num_threads()  # first touch: PyTorch initializes this thread's intra-op setting now ...
        torch.set_num_threads(1)  # ... so this one sticks to this thread (OpenMP keeps it per thread)
        started.set()
        restored.wait()
        seen.append(torch.get_num_threads())
        checked.set()
        while True:
            task, done = self.tasks.get()
            task()
            done.release()

    def grow(self, n: int) -> bool:
        """At least n workers; False when this PyTorch build cannot keep a worker single-threaded."""
        with self.lock:
            caller = torch.get_num_threads()
            while self.per_thread_setting is not False and len(self.threads) < n:
                started, restored, checked, seen = threading.Event(), threading.Event(), threading.Event(), []
                thread = threading.Thread(
                    target=self._work, args=(started, restored, checked, seen), daemon=True, name="moba-worker"
                )
                thread.start()
                started.wait()
                torch.set_num_threads(caller)  # the worker's set_num_threads(1) also set the default for new threads
                restored.set()
                checked.wait()
                self.threads.append(thread)
                # a single-threaded worker beside a caller that kept its threads: the setting is per thread
                self.per_thread_setting = seen[0] == 1 and torch.get_num_threads() == caller
            return bool(self.per_thread_setting)


_pool: _Pool | None = None


def _get_pool() -> _Pool:
    global _pool
    if _pool is None or _pool.pid != os.getpid():  # a forked child has none of the parent's threads
        _pool = _Pool()
    return _pool


def worker_count(device: torch.device) -> int:
    """How many parts run at once for work on `device`: the caller's intra-op threads on CPU, else 1."""
    if device.type != "cpu" or getattr(_local, "worker", False):
        return 1
    return max(1, torch.get_num_threads())


def run_all(parts: Sequence[Callable[[], T]], workers: int) -> list[T]:
    """Results of `parts` (independent callables) in order, all at once on single-threaded workers, or inline
    when `workers` <= 1 (make no more parts than `worker_count` says).

    The caller's autograd mode holds in every part. An exception in a part is raised here (after every part
    has finished, so nothing still writes into shared tensors).
    """
    if workers <= 1 or len(parts) <= 1 or not _get_pool().grow(len(parts)):
        return [part() for part in parts]
    return _on_workers(parts)


def run_single_threaded(fn: Callable[[], T], device: torch.device) -> T:
    """fn() on one single-threaded worker (inline off CPU, on one thread, or inside a worker): for work made of
    many short ops, which intra-op threads only slow down (each waits whenever one thread is descheduled)."""
    if worker_count(device) <= 1 or not _get_pool().grow(1):
        return fn()
    return _on_workers([fn])[0]


def _on_workers(parts: Sequence[Callable[[], T]]) -> list[T]:
    pool = _get_pool()
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    results: list = [None] * len(parts)
    errors: list[BaseException | None] = [None] * len(parts)

    def task(i: int) -> None:
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                results[i] = parts[i]()
        except BaseException as err:  # noqa: BLE001 -- handed to the caller below
            errors[i] = err

    done = threading.Semaphore(0)
    for i in range(len(parts)):
        pool.tasks.put((lambda i=i: task(i), done))
    for _ in parts:
        done.acquire()
    for err in errors:
        if err is not None:
            raise err
    return results
