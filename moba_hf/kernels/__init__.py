"""MoBA kernels: one public function, many backends, no transformers import.

Every backend is a `BackendFunction`, ``(q, k, v, plan, scale)`` as `moba_attention_reference`: the `BlockPlan`
says which keys each query sees, validated when it is built; `moba_attention` builds one from its keywords and
dispatches to a backend by name (`attend_plan` takes a plan). What a backend can do is data, one `Backend` entry
each in `_REGISTRY`; backends living in optional-dependency modules are imported lazily, and a missing dependency
(or an input the backend cannot take, or gradients it cannot compute) falls back to what "auto" picks, with one
log line per backend.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable, Iterator, Sequence

import torch

from .. import logs
from .causal import causal_attention, causal_attention_unchecked, with_dense_tail
from .checks import check_inputs, check_shapes, cuda_or_triton_interpreter, flash_attn_takes, flex_takes, needs_grad
from .plan import BackendFunction, BlockPlan
from .reference import moba_attention_reference
from .selection import GateOptions, gate_scores, selected_blocks

logger = logging.getLogger("moba_hf")


def _anywhere(q: torch.Tensor) -> bool:
    return True


def _cuda(q: torch.Tensor) -> bool:
    return q.is_cuda


@dataclasses.dataclass(frozen=True)
class Backend:
    """One kernel backend.

    loader:        "package.module:function", imported on first use (ImportError: unavailable)
    runs_on:       q -> whether the backend can run this input at all when asked for by name
    auto_may_pick: q -> whether "auto" may pick it (flex runs on CPU but compiles for minutes per shape)
    has_backward:  q -> whether it computes gradients for this input
    auto_rank:     "auto" tries backends by increasing rank; the first available one that may pick q wins
    """

    name: str
    loader: str
    runs_on: Callable[[torch.Tensor], bool] = _anywhere
    auto_may_pick: Callable[[torch.Tensor], bool] = _anywhere
    has_backward: Callable[[torch.Tensor], bool] = _anywhere
    auto_rank: int = 100


_REGISTRY: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("reference", "moba_hf.kernels.reference:moba_attention_reference", auto_rank=1000),
        Backend("torch", "moba_hf.kernels.torch_impl:moba_attention_torch", auto_rank=30),
        Backend("flex", "moba_hf.kernels.flex:moba_attention_flex", runs_on=flex_takes, auto_may_pick=_cuda,
                has_backward=_cuda, auto_rank=40),
        Backend("triton", "moba_hf.kernels.triton_impl:moba_attention_triton", runs_on=cuda_or_triton_interpreter,
                auto_may_pick=_cuda, auto_rank=10),
        Backend("flash", "moba_hf.kernels.flash:moba_attention_flash", runs_on=flash_attn_takes,
                auto_may_pick=flash_attn_takes, auto_rank=20),
    )
}  # fmt: skip
_loaded: dict[str, Callable] = {"reference": moba_attention_reference}
_unavailable: dict[str, str] = {}


class _Names(Sequence):
    """ "auto" and the registered backend names, read live (a backend registered later is a valid name)."""

    def _names(self) -> tuple[str, ...]:
        return ("auto", *_REGISTRY)

    def __getitem__(self, index):  # noqa: ANN001, ANN204 - Sequence protocol
        return self._names()[index]

    def __len__(self) -> int:
        return len(_REGISTRY) + 1

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name == "auto" or name in _REGISTRY

    def __repr__(self) -> str:
        return repr(self._names())


BACKENDS: Sequence[str] = _Names()


def register_backend(backend: Backend) -> None:
    """Add (or replace) a backend; `moba_attention(..., backend=backend.name)` and `MobaConfig(backend=...)`
    accept its name from then on. Its loader names a `BackendFunction`: ``fn(q, k, v, plan, scale)`` with the
    contract of `moba_attention_reference` (a plan without a dense tail; `attend_plan` applies the tail)."""
    if not backend.name or backend.name == "auto" or ":" not in backend.loader:
        raise ValueError(f"a backend needs a name other than 'auto' and a 'module:function' loader, got {backend}")
    _REGISTRY[backend.name] = backend
    _loaded.pop(backend.name, None)
    _unavailable.pop(backend.name, None)


def _load(name: str) -> Callable | None:
    if name in _loaded:
        return _loaded[name]
    if name in _unavailable or name not in _REGISTRY:
        return None
    module_name, func_name = _REGISTRY[name].loader.split(":")
    try:
        fn = getattr(importlib.import_module(module_name), func_name)
    except ImportError as err:  # optional dependency missing (triton, flash-attn)
        _unavailable[name] = str(err)
        return None
    _loaded[name] = fn
    return fn


def backend_available(name: str) -> bool:
    return _load(name) is not None


def resolve_backend(backend: str, q: torch.Tensor, *, needs_grad: bool = False) -> str:
    """The concrete backend `moba_attention(..., backend=backend)` runs for query `q` (and gradients when
    `needs_grad`)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        for entry in sorted(_REGISTRY.values(), key=lambda e: e.auto_rank):
            if entry.auto_may_pick(q) and (not needs_grad or entry.has_backward(q)) and _load(entry.name):
                return entry.name
        return "reference"
    entry = _REGISTRY[backend]
    reason = None
    if _load(backend) is None:
        reason = _unavailable.get(backend, "not importable")
    elif not entry.runs_on(q):
        reason = f"does not run on {q.device.type} {str(q.dtype).removeprefix('torch.')} tensors"
    elif needs_grad and not entry.has_backward(q):
        reason = f"has no backward on {q.device.type}"
    if reason is None:
        return backend
    fallback = resolve_backend("auto", q, needs_grad=needs_grad)
    logs.once(logging.WARNING, "moba_hf: backend %r unavailable (%s); falling back to %r", backend, reason, fallback)
    return fallback


def moba_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    scale: float | None = None,
    backend: str = "auto",
    pooling: str = "mean",
    sink_blocks: int = 0,
    local_blocks: int = 0,
    top_p: float | None = None,
    min_top_k: int = 1,
    dense_tail: int = 0,
) -> torch.Tensor:
    """Mixture of Block Attention.

    q: (batch, q_heads, Nq, head_dim); k, v: (batch, kv_heads, Nk, head_dim), q_heads % kv_heads == 0,
    Nq <= Nk: the queries are the last Nq key positions. Returns (batch, q_heads, Nq, head_dim), q's dtype.

    Keys are cut into blocks of `block_size`; each query attends its own block causally plus the
    `top_k - 1` earlier blocks with the highest gate score q . pool(K_block) (top_k counts the own block;
    top_k = 1 means own block only; top_k >= number of blocks means plain causal attention).
    `scale` defaults to head_dim ** -0.5 (else a finite number > 0; at most 3.4e38, float32's largest, for float32
    and 16-bit inputs, whose scores are float32; one that rounds to 0 there weighs every attended key equally, as
    in the reference); q, k, v: floating point, one dtype, one device.
    `pooling`, `sink_blocks`, `local_blocks`, `top_p` (an adaptive budget of at most top_k blocks),
    `min_top_k`: see `MobaConfig`. The last `dense_tail` queries (all of them when
    Nq <= dense_tail) attend every earlier key, as `causal_attention`. The keywords make a `BlockPlan`
    (`attend_plan` takes one).
    """
    gate = (pooling, sink_blocks, local_blocks, top_p, min_top_k)
    plan = BlockPlan.build(block_size, top_k, *gate, dense_tail=dense_tail)
    return attend_plan(q, k, v, plan, scale, backend=backend)


def attend_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    scale: float | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """`moba_attention` under a `BlockPlan` (its dense tail included) with the backend `backend`."""
    if not isinstance(plan, BlockPlan):
        raise ValueError(f"plan must be a BlockPlan, got {type(plan).__name__}")
    check_inputs(q, k, v, scale)
    name = resolve_backend(backend, q, needs_grad=needs_grad(q, k, v))
    logger.debug("moba_attention: backend=%s q=%s k=%s", name, tuple(q.shape), tuple(k.shape))
    run = _loaded[name]
    if not plan.dense_tail:
        return run(q, k, v, plan, scale)
    check_shapes(q, k, v)
    sparse = plan.sparse
    return with_dense_tail(
        q,
        k,
        v,
        plan.dense_tail,
        lambda q_, k_, v_: run(q_, k_, v_, sparse, scale),
        lambda q_, k_, v_: causal_attention_unchecked(q_, k_, v_, scale),
    )


__all__ = [
    "BACKENDS",
    "Backend",
    "BackendFunction",
    "BlockPlan",
    "GateOptions",
    "attend_plan",
    "backend_available",
    "causal_attention",
    "check_inputs",
    "check_shapes",
    "gate_scores",
    "moba_attention",
    "moba_attention_reference",
    "register_backend",
    "resolve_backend",
    "selected_blocks",
]
