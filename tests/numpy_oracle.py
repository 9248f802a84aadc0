"""An independent MXFP8 oracle in numpy/float64, written from the rules of docs/design.md §2 alone.

It shares no code with the package: amax and the scale rules use numpy's IEEE fp32 (numpy never
flushes subnormals), the cast is one float64 multiply (exact for these ranges) followed by
ml_dtypes' single correctly rounded float64 -> E4M3 conversion after saturating to +-448.
"""

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
INV448 = np.float32(1) / np.float32(448)
# docs/design.md §2: a NaN that arithmetic produces is written as this one pattern (positive,
# quiet bit only); its bf16 is 0x7FC0 and its E4M3 code 0x7F.
CANONICAL_NAN_F32 = 0x7FC00000
CANONICAL_NAN_BF16 = 0x7FC0
CANONICAL_NAN_E4M3 = 0x7F


def canonical_nan(y) -> np.ndarray:
    """fp32 array with every NaN (any sign, any payload) replaced by the canonical NaN."""
    b = np.ascontiguousarray(y, np.float32).view(np.uint32).copy()
    b[(b & 0x7FFFFFFF) > 0x7F800000] = CANONICAL_NAN_F32
    return b.view(np.float32)


def _amax(blocks64: np.ndarray) -> np.ndarray:
    a = np.abs(blocks64)
    a = np.where(np.isnan(a), 0.0, a)
    return a.max(axis=-1)


def scale_rceil(amax: np.ndarray) -> np.ndarray:
    v = (amax.astype(np.float32) * INV448).view(np.uint32)
    exp = (v >> 23).astype(np.int64)
    man = (v & 0x7FFFFF).astype(np.int64)
    up = (man != 0) & (exp != 0xFE) & ~((exp == 0) & (man <= 0x400000))
    byte = exp + up
    byte = np.where(np.isinf(amax), 0xFE, byte)
    return byte.astype(np.uint8)


def scale_floor(amax: np.ndarray) -> np.ndarray:
    """clamp(floor(log2(amax)) - 8 + 127, 0, 254); amax 0 -> 0; frexp is exact: a = m * 2^e,
    m in [0.5, 1), so floor(log2(a)) = e - 1."""
    finite = np.where(np.isinf(amax), 1.0, amax)
    _, e = np.frexp(finite)
    byte = np.clip(e.astype(np.int64) - 1 - 8 + 127, 0, 254)
    byte = np.where(np.isinf(amax), 254, byte)
    return np.where(amax == 0, 0, byte).astype(np.uint8)


def quantize_blocks(blocks, rule: str = "rceil"):
    """blocks [..., 32] of any float dtype -> (codes uint8 [..., 32], scales uint8 [...])."""
    with np.errstate(invalid="ignore"):
        b64 = np.asarray(blocks).astype(np.float64)
    amax = _amax(b64)
    scale = scale_rceil(amax) if rule == "rceil" else scale_floor(amax)
    mult = np.ldexp(1.0, 127 - scale.astype(np.int64))[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        y = np.clip(b64 * mult, -448.0, 448.0)
    return y.astype(E4M3).view(np.uint8), scale


def quantize(x, rule: str = "rceil"):
    """x [M, K] -> dict of the four planes as uint8 (columnwise needs M % 32 == 0)."""
    x = np.asarray(x)
    m, k = x.shape
    rq, rs = quantize_blocks(x.reshape(m, k // 32, 32), rule)
    out = {"rowwise_data": rq.reshape(m, k), "rowwise_scale": rs}
    if m % 32 == 0:
        xt = x.reshape(m // 32, 32, k).transpose(0, 2, 1)
        cq, cs = quantize_blocks(xt, rule)
        out["columnwise_data"] = cq.transpose(0, 2, 1).reshape(m, k)
        out["columnwise_scale"] = cs
    return out


def dequantize_rowwise(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """float64 values of rowwise planes (exact)."""
    vals = q.view(E4M3).astype(np.float64)
    return vals * np.ldexp(1.0, np.repeat(s.astype(np.int64), 32, axis=1) - 127)


def dequantize_columnwise(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """float64 values of columnwise planes (exact): codes [M, K], scales [M/32, K]."""
    vals = q.view(E4M3).astype(np.float64)
    return vals * np.ldexp(1.0, np.repeat(s.astype(np.int64), 32, axis=0) - 127)


def mxfp8_weights(w, rule: str = "rceil"):
    """``(rowwise, columnwise)`` float64 values of ``w [M, K]`` after MXFP8 quantization: what a
    GEMM contracting over K (rowwise blocks) or over M (columnwise blocks) reads."""
    p = quantize(np.asarray(w, np.float32), rule)
    return (
        dequantize_rowwise(p["rowwise_data"], p["rowwise_scale"]),
        dequantize_columnwise(p["columnwise_data"], p["columnwise_scale"]),
    )


def quantize_tiles(x, rule: str = "rceil"):
    """x [M, K] (both multiples of 32) -> (codes uint8 [M, K], scales uint8 [M/32, K/32]): one
    scale per 32x32 tile, each tile quantized as one block of 1024 elements."""
    x = np.asarray(x)
    m, k = x.shape
    tiles = x.reshape(m // 32, 32, k // 32, 32).transpose(0, 2, 1, 3).reshape(m // 32, k // 32, 1024)
    q, s = quantize_blocks(tiles, rule)
    return q.reshape(m // 32, k // 32, 32, 32).transpose(0, 2, 1, 3).reshape(m, k), s
