"""CPU kernels compiled from C at first use, for work that torch ops do in too many small calls.

A sparse decode step reads a few thousand keys: tens of microseconds of arithmetic, which as torch ops is a dozen
calls of 5-40 µs each (more once the rest of a layer has swept the CPU caches). `decode_step.c` does the gate, the
pick and the attention in one call. It is built by the system C compiler ($CC, else `cc`) for this machine's CPU
into $MOBA_HF_CACHE/native/<digest>/ the first time a process needs it (under a second), kept there for later
processes, and loaded with ctypes; it runs on torch's OpenMP thread pool. Where there is no compiler, or the build
fails, `decode_step()` says so once in the log and returns None, and the caller runs its torch ops, which compute
the same attention.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from ... import logs
from ...rundir import cache_root

logger = logging.getLogger("moba_hf")

SOURCE = Path(__file__).with_name("decode_step.c")
# -march=native: the binary is for the CPU it was built on (the digest names the CPU); no -ffast-math, which would
# reorder the sums and drop NaN / inf handling
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
SERIAL_FLAGS = tuple(f for f in FLAGS if f != "-fopenmp")  # a compiler without OpenMP: one thread per step
# decode_step.c's limits (its MAX_*): picks per row, head dim, query heads per KV head
MAX_PICKS, MAX_D, MAX_GROUP = 64, 256, 16

_lock = threading.Lock()
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _cpu() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(lines))


def build(compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """The shared library of `decode_step.c` built with `flags`, from the cache when built before."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu().encode()]))
    target = cache_root() / "native" / digest.hexdigest()[:16] / "decode_step.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # built under a temporary name and renamed: processes building at once each write their own file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, check=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):  # the build line is gcc / clang on Linux
        return None
    compiler = _compiler()
    if compiler is None:
        logs.once(logging.INFO, "moba_hf: no C compiler ($CC or cc): sparse decode steps run as torch ops")
        return None
    failures = []
    for flags in (FLAGS, SERIAL_FLAGS):
        try:
            return load(build(compiler, flags))
        except (OSError, subprocess.CalledProcessError) as err:
            failures.append(err.stderr.strip()[-300:] if isinstance(err, subprocess.CalledProcessError) else str(err))
    logs.once(logging.WARNING, "moba_hf: building the native decode step failed (%s): torch ops run it", failures[-1])
    return None


def load(path: Path) -> ctypes.CDLL:
    """The built library at `path`, its entry point typed."""
    lib = ctypes.CDLL(str(path))
    fn = lib.moba_decode_step
    fn.restype = ctypes.c_int
    # q, gate_q, rows, d, width, group; pooled and its strides; k, v, step, start, n, block size, lo, hi, n_pick;
    # scale; out, picks; threads
    fn.argtypes = [*[_ptr] * 2, *[_i64] * 4, _ptr, *[_i64] * 2, *[_ptr] * 2, *[_i64] * 7, ctypes.c_float]
    fn.argtypes += [_ptr, _ptr, ctypes.c_int]
    append = lib.moba_block_append
    append.restype = None
    # stats, its stride; pooled, its stride; x, its stride; runs, d, width, split; bound; count
    append.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _i64, *[_i64] * 4, ctypes.c_int, _i64]
    return lib


_loaded: ctypes.CDLL | None = None  # the library once loaded: read without the lock by every step


def _get() -> ctypes.CDLL | None:
    global _loaded
    if _loaded is None:
        with _lock:
            _loaded = _library()
    return _loaded


def available() -> bool:
    """Whether the native kernels are built and loaded (builds them on the first call)."""
    return _get() is not None


def decode_step(q, gate_q, pooled, cache, blocks, scale, out, picks) -> bool:
    """One decode step of `decode_step.c` (see there for the layout), or False when the native kernel is not
    available (nothing written). q [B, Hq, 1, D] contiguous float32; gate_q: q's features for the gate, [B * Hq, W]
    contiguous (None: q itself); pooled [B, Hkv, blocks, W] float32, its last dim contiguous, its (row, head) runs
    evenly spaced (checked by the caller); cache = (k, v, step, start, n): float32 keys and values laid out as
    `decode._storage_rows` reads them with row stride `step`, each row's sequence at cache positions start ..
    start + n - 1; blocks = (block size, lo, hi, n_pick): the candidates lo .. hi - 1 and how many to pick; out
    [B, Hq, 1, D] contiguous, written; picks: None, or [B * Hq, n_pick] int64 contiguous, written with block index
    - lo."""
    lib = _get()
    if lib is None:
        return False
    k, v, step, start, n = cache
    block_size, lo, hi, n_pick = blocks
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    queries = (q.data_ptr(), (q if gate_q is None else gate_q).data_ptr(), b * hq, d, pooled.shape[3], hq // hkv)
    gate = (pooled.data_ptr(), pooled.stride(1) if hkv > 1 else pooled.stride(0), pooled.stride(2))
    keys = (k.data_ptr(), v.data_ptr(), step, start, n, block_size, lo, hi, n_pick, scale)
    written = (out.data_ptr(), None if picks is None else picks.data_ptr(), torch.get_num_threads())
    rc = lib.moba_decode_step(*queries, *gate, *keys, *written)
    if rc != 0:
        raise MemoryError(
            f"moba_hf: the native decode step failed (code {rc}): out of memory or shapes past its limits"
        )
    return True


def block_append(pool, stats: torch.Tensor, pooled: torch.Tensor, block: int, keys: torch.Tensor, count: int) -> bool:
    """One new key per row merged into block `block` of the statistics and its pooled key re-derived (`pool`, a
    `BlockStats`: its merge_ then pool_into), in one call; False (nothing written) where the native kernel is not
    available or the tensors are not float32 with evenly spaced (row, head) runs. stats, pooled: [B, Hkv, blocks,
    W]; keys: [B, Hkv, 1, D], the new keys; count: the block's keys after the merge."""
    lib = _get()
    if lib is None or not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (stats, pooled, keys)):
        return False
    b, hkv = keys.shape[:2]
    runs = []
    for t in (stats, pooled, keys):
        if t.stride(-1) != 1 or (b > 1 and hkv > 1 and t.stride(0) != hkv * t.stride(1)):
            return False
        runs.append(t.stride(1) if hkv > 1 else t.stride(0))
    size = stats.element_size()
    rows = [stats.data_ptr() + block * stats.stride(2) * size, runs[0]]
    rows += [pooled.data_ptr() + block * pooled.stride(2) * size, runs[1], keys.data_ptr(), runs[2]]
    shape = (b * hkv, pool.head_dim, pool.width, pool.max_start, int(pool.pooling == "bound"), count)
    lib.moba_block_append(*rows, *shape)
    return True
