"""Whether a value is being traced (under ``jit``, ``grad``, ``vmap``, ``shard_map``...).

Eager calls take compiled shortcuts (one cached executable per configuration, host-side
packing); traced calls stay plain operations of the caller's program. One test for it, so the
tracer class is looked up in one place across jax versions.
"""

from __future__ import annotations

import jax

try:
    _TRACER = jax.core.Tracer
except AttributeError:  # jax versions that no longer export it from jax.core
    from jax._src.core import Tracer as _TRACER


def is_traced(*xs) -> bool:
    """Whether any of ``xs`` is a tracer."""
    return any(isinstance(x, _TRACER) for x in xs)
