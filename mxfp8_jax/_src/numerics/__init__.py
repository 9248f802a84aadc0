"""The MXFP8 rules in pure JAX (scale rules, casts, blocks) and the MXFP8Tensor pytree: the
reference every kernel is tested against."""
