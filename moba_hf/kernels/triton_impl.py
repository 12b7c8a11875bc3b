"""Backend "triton": not implemented in this version.

Importing this module raises ImportError on purpose, so `moba_attention(..., backend="triton")` falls back to
the best available backend with one log line (see `moba_hf.kernels.resolve_backend`) instead of pretending.
On CUDA, "flex" (compiled Triton through torch.compile) and "torch" are the GPU paths meanwhile.
"""

raise ImportError("the Triton MoBA kernel is not implemented yet (issue 3); use backend 'flex' or 'torch' on CUDA")
