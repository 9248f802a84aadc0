"""Checkpoint test tensors, defined by a formula that numpy and jax both evaluate exactly.

Element ``j`` of tensor ``t`` has the bit pattern ``(j * 2654435761 + 40503 * (t + 1)) mod 2**32``
(float32), or its top 16 bits (bfloat16): every pattern appears, NaN payloads, infinities and
subnormals included, so a byte comparison catches any conversion. ``finite=True`` maps the
patterns to finite values in [-4, 4) (for quantization). The multi-process workers build the
same tensors on the devices (``device_tensor``); the tests build them with numpy (``host_tensor``).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

MUL, ADD = 2654435761, 40503


def _pattern(n: int, t: int, xp):
    j = xp.arange(n, dtype=xp.uint32)
    return j * xp.uint32(MUL) + xp.uint32((ADD * (t + 1)) % 2**32)


def host_tensor(shape, t: int, dtype=np.float32, finite: bool = False) -> np.ndarray:
    with np.errstate(over="ignore"):
        bits = _pattern(math.prod(shape), t, np)
    if finite:
        return (
            ((bits >> np.uint32(8)).astype(np.float32) / np.float32(2**21) - np.float32(4)).astype(dtype).reshape(shape)
        )
    if np.dtype(dtype) == np.float32:
        return bits.view(np.float32).reshape(shape)
    assert np.dtype(dtype) == ml_dtypes.bfloat16
    return (bits >> np.uint32(16)).astype(np.uint16).view(ml_dtypes.bfloat16).reshape(shape)


def device_tensor(shape, t: int, sharding, dtype="float32", finite: bool = False):
    """The same tensor made on the devices, directly in ``sharding`` (no host copy)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def make():
        bits = _pattern(math.prod(shape), t, jnp)
        if finite:
            x = (bits >> 8).astype(jnp.float32) / jnp.float32(2**21) - jnp.float32(4)
            return x.astype(dtype).reshape(shape)
        if jnp.dtype(dtype) == jnp.float32:
            return lax.bitcast_convert_type(bits, jnp.float32).reshape(shape)
        return lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16).reshape(shape)

    return jax.jit(make, out_shardings=sharding)()
