"""Mixture-of-Experts at run time: the mode and sizes (``sizing``), where expert bytes are (``layout``),
the device pool and cache (``pool``), how experts compute (``compute``: fused kernels, grouped, GEMV), the host-CPU
path (``host``) and the one-kernel copy (``uva_copy``)."""
