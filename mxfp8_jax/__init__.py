"""mxfp8_jax: MXFP8 (OCP microscaling FP8) for JAX.

Exact MXFP8 numerics (one rule set for the pure-JAX reference and the CPU/CUDA/ROCm kernels),
sharded FSDP buffers of MXFP8 planes, and a fused all-gather + RMSNorm + MXFP8 quantize.
"""

from mxfp8_jax._src._ffi import ExtensionMissingError, available_backends
from mxfp8_jax._src.cpu_isa import cpu_isa, cpu_isas, set_cpu_isa, use_cpu_isa
from mxfp8_jax._src.format import BLOCK, ScaleRule, e8m0_to_float32, e8m0_view
from mxfp8_jax._src.quantize import dequantize, quantize
from mxfp8_jax._src.tensor import (
    MXFP8Tensor,
    PaddedMXFP8Tensor,
    pad_columnwise_scale,
    pad_rowwise_scale,
    swizzle_scale,
    update_mxfp8_tensor,
)

from mxfp8_jax._src.layout import GlobalLayout, ShardLayout
from mxfp8_jax._src.placement import (
    BlockAtomic,
    Partial,
    Replicate,
    RowAtomic,
    partition_spec,
    segments_of_shard,
)
from mxfp8_jax._src.dbuffer import DBuffer
from mxfp8_jax._src.quantized import QuantizedDBuffer
from mxfp8_jax._src.te import from_te, to_te
from mxfp8_jax._src.rmsnorm import rmsnorm_quant
from mxfp8_jax._src.fused import (
    ExperimentalGpuP2PWarning,
    allgather_rmsnorm_quant,
    allgather_rmsnorm_quant_local,
)

__version__ = "0.1.0"

__all__ = [
    "allgather_rmsnorm_quant",
    "allgather_rmsnorm_quant_local",
    "rmsnorm_quant",
    "BlockAtomic",
    "DBuffer",
    "GlobalLayout",
    "Partial",
    "QuantizedDBuffer",
    "Replicate",
    "RowAtomic",
    "ShardLayout",
    "partition_spec",
    "segments_of_shard",
    "BLOCK",
    "ExperimentalGpuP2PWarning",
    "ExtensionMissingError",
    "MXFP8Tensor",
    "PaddedMXFP8Tensor",
    "ScaleRule",
    "available_backends",
    "cpu_isa",
    "cpu_isas",
    "set_cpu_isa",
    "use_cpu_isa",
    "dequantize",
    "e8m0_to_float32",
    "e8m0_view",
    "pad_columnwise_scale",
    "pad_rowwise_scale",
    "quantize",
    "swizzle_scale",
    "update_mxfp8_tensor",
    "to_te",
    "from_te",
]
