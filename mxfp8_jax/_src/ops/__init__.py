"""The public ops: quantize / dequantize, RMSNorm + quantize, the fused all-gather + RMSNorm +
quantize, and MXFP8 GEMMs; each runs its kernel or its pure-JAX reference."""
