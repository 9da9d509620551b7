"""Diagnostic kernels (Triton, CUDA C++) with torch reference implementations and CPU fallbacks.

vigil.kernels: its public API is re-exported here as it lands.
"""

__all__: list[str] = []
