"""Packed-sequence attention: host-built metadata (``metadata``) and per-backend kernels (``kernels``).

The public entry points live in :mod:`fastsft_lab.packed`.
"""

from .kernels import BACKENDS, BackendStatus, available_backends
from .metadata import PackedMetadata

__all__ = ["PackedMetadata", "BACKENDS", "BackendStatus", "available_backends"]
