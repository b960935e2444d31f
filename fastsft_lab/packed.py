"""Deprecated: ``fastsft_lab.packed`` is now :mod:`fastsft_lab.packing` (this alias stays for one release)."""

import warnings

from .packing import *  # noqa: F401,F403
from .packing import __all__  # noqa: F401

warnings.warn("fastsft_lab.packed is deprecated: import fastsft_lab.packing", DeprecationWarning, stacklevel=2)
