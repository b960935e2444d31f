"""The packed-attention backends, one file each; importing a file registers its backend (in this order)."""

from . import sdpa, eager, varlen, flex, xformers, flash, segments  # noqa: F401  (registration order = BACKENDS order)
