"""Small Flax NNX language models written the ways public Flax NNX code writes them.

Each style is a decoder LM (int32 tokens ``[batch, seq]`` -> fp32 logits ``[batch, seq, vocab]``,
trained with next-token cross entropy) built only from plain Flax NNX and JAX, in the idiom of
a family of public code bases:

- ``"mha"``: stock ``nnx`` layers (``nnx.Embed``, ``nnx.LayerNorm``, ``nnx.MultiHeadAttention``,
  ``nnx.Linear``), blocks stacked by ``nnx.vmap`` and run by ``nnx.scan``, as in Flax's guides.
- ``"gemma"``: the Gemma reference decoders: ``nnx.Einsum`` projections with multi-axis kernels
  (a stacked k/v kernel), a gated MLP kept as raw parameters, a tied embedding.
- ``"maxtext"``: a ``DenseGeneral`` layer whose kernel is ``(*in_features, *out_features)``
  applied with ``lax.dot_general`` over several trailing axes, as large-scale JAX trainers do.
- ``"einsum"``: hand-written layers holding ``nnx.Param`` arrays contracted by ``jnp.einsum`` or
  ``@``, an embedding table read by indexing, an untied head matrix.
- ``"moe"``: a Switch-Transformer-style top-1 mixture of experts with stacked expert weights and
  dense one-hot dispatch/combine tensors.
- ``"dropout"``: ``nnx.Dropout`` (and attention dropout) layers that keep their own RNG streams.

The models themselves know nothing of any training library. Each style is a module of this
package; its model class says its name and description (``STYLE``, ``DESCRIPTION``), and each
layer class holding raw parameters says how they are initialized (``PARAM_INIT``, see
``config``). ``build`` gives a model with values drawn on the host by numpy (no compilation,
whatever the depth), ``abstract`` the same structure with ``jax.ShapeDtypeStruct`` values.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mxfp8_jax.bench.styles import dropout, einsum, gemma, maxtext, mha, moe
from mxfp8_jax.bench.styles.config import StyleConfig

_MODELS: dict[str, type[nnx.Module]] = {
    cls.STYLE: cls
    for cls in (
        mha.MHAModel,
        gemma.GemmaModel,
        maxtext.MaxTextModel,
        einsum.EinsumModel,
        moe.MoEModel,
        dropout.DropoutModel,
    )
}
STYLES: tuple[str, ...] = tuple(_MODELS)
_DEFAULT_CONFIG = StyleConfig()


def _check_style(style: str) -> type[nnx.Module]:
    if style not in _MODELS:
        raise ValueError(f"style must be one of {STYLES}, got style={style!r}")
    return _MODELS[style]


def describe(style: str) -> str:
    """One line: how the style is written (layers used, scan or loop, tied or not)."""
    return _check_style(style).DESCRIPTION


def abstract(style: str, cfg: StyleConfig = _DEFAULT_CONFIG) -> nnx.Module:
    """The model's structure with ``jax.ShapeDtypeStruct`` values (``nnx.eval_shape``)."""
    cls = _check_style(style)
    if not isinstance(cfg, StyleConfig):
        raise ValueError(f"cfg must be a StyleConfig, got {type(cfg).__name__}")
    return nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(params=0, dropout=1)))


def _einsum_fan_in(spec: str, shape: tuple[int, ...]) -> int:
    inputs, out = spec.split("->")
    _, kernel = inputs.split(",")
    lead = len(shape) - len(kernel)  # stacked-layer axes in front
    return math.prod(shape[lead + i] for i, c in enumerate(kernel) if c not in out)


def _rule(module: nnx.Module, name: str, shape: tuple[int, ...]) -> tuple[str, float]:
    """(kind, std) of the parameter ``name`` of ``module``; kind is "normal", "ones", "zeros" or
    "embed": Flax's own layers by their kind, the others by their class's ``PARAM_INIT``."""
    if name == "bias" and isinstance(module, (nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nnx.LayerNorm)):
        return "zeros", 0.0
    if name == "scale" and isinstance(module, (nnx.LayerNorm, nnx.RMSNorm)):
        return "ones", 0.0
    if name == "embedding" and isinstance(module, nnx.Embed):
        return "embed", 0.0
    if name == "kernel":
        if isinstance(module, nnx.Linear):
            return "normal", module.in_features**-0.5
        if isinstance(module, nnx.LinearGeneral):
            return "normal", math.prod(module.in_features) ** -0.5
        if isinstance(module, nnx.Einsum):
            return "normal", _einsum_fan_in(module.einsum_str, shape) ** -0.5
    rule = getattr(type(module), "PARAM_INIT", {}).get(name)
    if rule is None:
        raise ValueError(f"no initialization rule for parameter {name!r} of {type(module).__name__}")
    if rule[0] == "kernel":
        return "normal", math.prod(shape[a] for a in rule[1]) ** -0.5
    if rule[0] == "in_features":
        return "normal", math.prod(module.in_features) ** -0.5
    return rule[0], 0.0


def build(style: str, cfg: StyleConfig = _DEFAULT_CONFIG, *, seed: int = 0) -> nnx.Module:
    """The model with values drawn on the host by ``np.random.default_rng(seed)``: kernels
    ``N(0, 1/fan_in)`` (fan_in: the product of the axes the kernel contracts), embeddings
    ``N(0, 1)`` (or ``N(0, EMBED_STD^2)`` where the model class sets it: the tied ``"gemma"``
    table, read back times ``sqrt(width)``, is ``N(0, 0.02^2)``), norm scales ones, biases
    zeros; dropout streams keyed from the same generator. Structure from ``nnx.eval_shape``,
    values set in place: nothing compiled that grows with the depth (only one tiny key split,
    for the dropout streams). Unknown ``style``: ValueError."""
    model = abstract(style, cfg)
    rng = np.random.default_rng(seed)
    embed_std = getattr(_MODELS[style], "EMBED_STD", 1.0)
    graph = list(nnx.iter_graph(model))
    owner = {path: node for path, node in graph}
    seen: set[int] = set()
    for path, var in graph:
        if not isinstance(var, nnx.Variable) or id(var) in seen:
            continue
        seen.add(id(var))
        module, name = owner[path[:-1]], path[-1]
        aval = var.get_value()
        shape, dtype = tuple(aval.shape), aval.dtype
        if isinstance(var, nnx.Param):
            kind, std = _rule(module, name, shape)
            if kind == "embed":
                kind, std = "normal", embed_std
            if kind == "normal":
                value = rng.standard_normal(shape) * std
            else:
                value = np.ones(shape) if kind == "ones" else np.zeros(shape)
            var.set_value(jnp.asarray(value.astype(dtype)))
        elif isinstance(var, nnx.RngKey):
            keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), max(1, math.prod(shape)))
            var.set_value(keys.reshape(shape))
        elif isinstance(var, nnx.RngCount):
            var.set_value(jnp.zeros(shape, dtype))
        else:
            raise ValueError(f"build: no value for {type(var).__name__} at {'/'.join(map(str, path))}")
    left = [path for path, v in nnx.to_flat_state(nnx.state(model)) if isinstance(v.get_value(), jax.ShapeDtypeStruct)]
    if left:
        raise ValueError(f"build({style!r}): variables left without values: {left}")
    return model


def loss_fn(model: Callable, batch) -> jax.Array:
    """Mean next-token cross entropy; ``batch = (inputs [B, T] int32, targets [B, T] int32)``."""
    inputs, targets = batch
    logits = model(inputs).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1))


def make_batch(cfg: StyleConfig, batch: int, seq: int, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random tokens (numpy int32): ``inputs [batch, seq]`` and ``targets`` shifted by one."""
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab, (batch, seq + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]
