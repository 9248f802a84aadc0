"""The ``"maxtext"`` style: every projection a ``DenseGeneral`` over several axes, blocks created stacked
by ``nnx.vmap`` and run by ``nnx.scan``, as large-scale JAX trainers write them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from mxfp8_jax.bench.styles.blocks import scanned, stacked
from mxfp8_jax.bench.styles.config import IN_FEATURES, StyleConfig


def _tuple(x) -> tuple[int, ...]:
    return tuple(x) if isinstance(x, Sequence) else (x,)


class DenseGeneral(nnx.Module):
    """A dense layer over several input axes into several output axes: the kernel is one
    ``nnx.Param`` of shape ``(*in_features, *out_features)`` contracted with the input's
    ``axis`` by ``lax.dot_general``."""

    PARAM_INIT: ClassVar[dict[str, tuple]] = {"kernel": IN_FEATURES}

    def __init__(self, in_features, out_features, axis=-1, *, rngs: nnx.Rngs):
        self.in_features = _tuple(in_features)
        self.out_features = _tuple(out_features)
        self.axis = _tuple(axis)
        if len(self.axis) != len(self.in_features):
            raise ValueError(f"DenseGeneral: axis {self.axis} does not match in_features {self.in_features}")
        n_in = len(self.in_features)
        init = nnx.initializers.lecun_normal(
            in_axis=tuple(range(n_in)), out_axis=tuple(range(n_in, n_in + len(self.out_features)))
        )
        self.kernel = nnx.Param(init(rngs.params(), self.in_features + self.out_features, jnp.float32))

    def __call__(self, inputs):
        axis = tuple(a % inputs.ndim for a in self.axis)
        kernel = self.kernel[...]
        contract = (axis, tuple(range(len(axis))))
        return jax.lax.dot_general(inputs, kernel, (contract, ((), ())))


class MaxTextAttention(nnx.Module):
    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        nh = (cfg.heads, cfg.head_dim)
        self.query = DenseGeneral(cfg.width, nh, rngs=rngs)
        self.key = DenseGeneral(cfg.width, nh, rngs=rngs)
        self.value = DenseGeneral(cfg.width, nh, rngs=rngs)
        self.out = DenseGeneral(nh, cfg.width, axis=(-2, -1), rngs=rngs)

    def __call__(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        return self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True))


class MaxTextMLP(nnx.Module):
    """SwiGLU with the gate and up projections fused in one ``[D, 2, F]`` kernel."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.wi = DenseGeneral(cfg.width, (2, cfg.mlp), rngs=rngs)
        self.wo = DenseGeneral(cfg.mlp, cfg.width, rngs=rngs)

    def __call__(self, x):
        h = self.wi(x)
        return self.wo(nnx.silu(h[..., 0, :]) * h[..., 1, :])


class MaxTextBlock(nnx.Module):
    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.pre_self_attention_norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.self_attention = MaxTextAttention(cfg, rngs=rngs)
        self.post_self_attention_norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.mlp = MaxTextMLP(cfg, rngs=rngs)

    def __call__(self, x):
        x = x + self.self_attention(self.pre_self_attention_norm(x))
        return x + self.mlp(self.post_self_attention_norm(x))


class MaxTextModel(nnx.Module):
    """A decoder in the manner of large-scale JAX LLM trainers: every projection a
    ``DenseGeneral`` (query/key/value ``[D, N, H]``, output ``[N, H, D]`` contracted over two
    axes, fused MLP input ``[D, 2, F]``), ``nnx.RMSNorm``, blocks created stacked by ``nnx.vmap``
    and run by ``nnx.scan`` (``nnx.remat`` per iteration when ``cfg.remat``), ``nnx.Embed``
    tokens and an untied ``DenseGeneral`` logits head."""

    STYLE = "maxtext"
    DESCRIPTION = (
        "MaxText-like: DenseGeneral (nnx.Param kernel (*in, *out), lax.dot_general) for q/k/v [D,N,H], "
        "out [N,H,D], MLP [D,2,F]/[F,D] and head; nnx.RMSNorm; vmap-stacked, nnx.scan (remat optional); nnx.Embed"
    )

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.remat = cfg.remat
        self.token_embedder = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
        self.layers = stacked(MaxTextBlock, cfg, rngs)
        self.decoder_norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.logits_dense = DenseGeneral(cfg.width, cfg.vocab, rngs=rngs)

    def __call__(self, tokens):
        x = scanned(self.layers, self.token_embedder(tokens), self.remat)
        return self.logits_dense(self.decoder_norm(x))
