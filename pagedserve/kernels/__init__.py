"""KV-cache ops: torch references (CPU path, test oracle) and Triton kernels (CUDA).

Use :mod:`pagedserve.kernels.ops` from model code; it dispatches by device.
"""
