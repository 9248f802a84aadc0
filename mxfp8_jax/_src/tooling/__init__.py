"""Around the library: Transformer Engine interop, HLO accounting, local multi-process runs."""
