"""Around the library: Transformer Engine interop, XLA's GPU descriptions, local multi-process runs."""
