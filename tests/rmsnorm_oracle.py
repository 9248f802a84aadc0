"""Independent numpy oracles for the fused RMSNorm + MXFP8 tests.

``canonical``: the evaluation order pinned in numerics.h, in numpy float32 (IEEE, subnormals
kept): 32 partial sums, partial j taking x[256 i + 8 j + v]^2 in increasing i then v, a pairwise
tree, inv = 1 / sqrt(sumsq / H + eps), y = (x * inv) * (gamma + offset) with a NaN made the
canonical NaN (docs/design.md §2), bf16 round to nearest even on the bits. ``float64``: the same
math in float64, for the 1-ulp check.
"""

import ml_dtypes
import numpy as np

from numpy_oracle import canonical_nan

BF16 = ml_dtypes.bfloat16


def bf16_bits_rne(y: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (uint16), round to nearest even, NaN made quiet."""
    b = np.ascontiguousarray(y, np.float32).view(np.uint32).astype(np.uint64)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return np.where(nan, (b >> 16) | 0x40, rounded).astype(np.uint16)


def canonical(x, gamma, *, eps: float, offset: float = 0.0):
    """Returns (normed as bf16 numpy array [R, H], the unrounded fp32 y [R, H])."""
    xf = np.asarray(x).astype(np.float32)
    r, h = xf.shape
    part = np.zeros((r, 32), np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # Inf/NaN rows on purpose
        for base in range(0, h, 256):
            lanes = min(32, (h - base) // 8)
            for v in range(8):
                cols = base + 8 * np.arange(lanes) + v
                part[:, :lanes] = part[:, :lanes] + xf[:, cols] * xf[:, cols]
        for s in (16, 8, 4, 2, 1):
            part[:, :s] = part[:, :s] + part[:, s : 2 * s]
        inv = np.float32(1.0) / np.sqrt(part[:, 0] / np.float32(h) + np.float32(eps))
        g = np.asarray(gamma).astype(np.float32) + np.float32(offset)
        y = canonical_nan((xf * inv[:, None]) * g)
    return bf16_bits_rne(y).view(BF16).reshape(r, h), y


def float64(x, gamma, *, eps: float, offset: float = 0.0) -> np.ndarray:
    xd = np.asarray(x).astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(xd * xd, axis=-1, keepdims=True) + eps)
    return xd * inv * (np.asarray(gamma).astype(np.float64) + offset)


def within_one_bf16_ulp(normed, ref64) -> np.ndarray:
    """|normed - ref| <= one bf16 ulp at the magnitude of ref (elementwise mask)."""
    got = np.asarray(normed).astype(np.float64)
    mag = np.maximum(np.abs(ref64), np.finfo(np.float32).tiny)
    ulp = np.exp2(np.floor(np.log2(mag)) - 7)
    return np.abs(got - ref64) <= ulp
