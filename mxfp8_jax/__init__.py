"""mxfp8_jax: MXFP8 (OCP microscaling FP8) for JAX.

Exact MXFP8 numerics (one rule set for the pure-JAX reference and the CPU/CUDA/ROCm kernels),
sharded FSDP buffers of MXFP8 planes, and a fused all-gather + RMSNorm + MXFP8 quantize.
"""

from mxfp8_jax._src.buffers.dbuffer import DBuffer
from mxfp8_jax._src.buffers.layout import GlobalLayout, ShardLayout
from mxfp8_jax._src.buffers.placement import (
    BlockAtomic,
    Partial,
    Replicate,
    RowAtomic,
    partition_spec,
    segments_of_shard,
)
from mxfp8_jax._src.buffers.quantized import QuantizedDBuffer
from mxfp8_jax._src.kernels._ffi import ExtensionMissingError, GpuFallbackWarning, available_backends
from mxfp8_jax._src.kernels.cpu_isa import cpu_isa, cpu_isas, set_cpu_isa, use_cpu_isa
from mxfp8_jax._src.numerics.format import BLOCK, ScaleRule, e8m0_to_float32, e8m0_view
from mxfp8_jax._src.numerics.tensor import (
    MXFP8Tensor,
    MXFP8Tensor2D,
    PaddedMXFP8Tensor,
    pad_columnwise_scale,
    pad_rowwise_scale,
    swizzle_scale,
    update_mxfp8_tensor,
)
from mxfp8_jax._src.ops.fused import (
    ExperimentalGpuP2PWarning,
    allgather_rmsnorm_quant,
    allgather_rmsnorm_quant_local,
)
from mxfp8_jax._src.ops.quantize import dequantize, quantize
from mxfp8_jax._src.ops.rmsnorm import rmsnorm_quant
from mxfp8_jax._src.tooling.te import from_te, to_te

__version__ = "0.1.0"

__all__ = [
    "BLOCK",
    "BlockAtomic",
    "DBuffer",
    "ExperimentalGpuP2PWarning",
    "ExtensionMissingError",
    "GlobalLayout",
    "GpuFallbackWarning",
    "MXFP8Tensor",
    "MXFP8Tensor2D",
    "PaddedMXFP8Tensor",
    "Partial",
    "QuantizedDBuffer",
    "Replicate",
    "RowAtomic",
    "ScaleRule",
    "ShardLayout",
    "allgather_rmsnorm_quant",
    "allgather_rmsnorm_quant_local",
    "available_backends",
    "cpu_isa",
    "cpu_isas",
    "dequantize",
    "e8m0_to_float32",
    "e8m0_view",
    "from_te",
    "pad_columnwise_scale",
    "pad_rowwise_scale",
    "partition_spec",
    "quantize",
    "rmsnorm_quant",
    "segments_of_shard",
    "set_cpu_isa",
    "swizzle_scale",
    "to_te",
    "update_mxfp8_tensor",
    "use_cpu_isa",
]
