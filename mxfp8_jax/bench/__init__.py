"""Benchmarks (not tests): each prints a table and can write JSON; run as python -m mxfp8_jax.bench.<name>."""
