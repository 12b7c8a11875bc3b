"""Backend "flash" (flash-attn varlen): not implemented in this version.

Importing this module raises ImportError on purpose, so `moba_attention(..., backend="flash")` falls back to
the best available backend with one log line (see `moba_hf.kernels.resolve_backend`). flash-attn's public
functions return the log-sum-exp of a forward but have no public backward that takes the merged output and
log-sum-exp of several pieces, which the gather-and-merge MoBA backward needs.
"""

raise ImportError("the flash-attn MoBA backend is not implemented yet (issue 3); use backend 'torch' or 'flex'")
