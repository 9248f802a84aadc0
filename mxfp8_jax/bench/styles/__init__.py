"""Models of the tests and benchmarks, written the ways public Flax NNX code writes them.

``model_styles``: decoder LMs in six styles (one module each: ``mha``, ``gemma``, ``maxtext``,
``einsum``, ``moe``, ``dropout``, over ``config`` and ``blocks``); ``stacked_styles``: LMs whose
layers are read by index, skipped, shared or frozen. Nothing in the library imports them.
"""
