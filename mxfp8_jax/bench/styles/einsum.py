"""The ``"einsum"`` style: hand-written layers holding ``nnx.Param`` arrays contracted by ``jnp.einsum`` or
``@``, an embedding table read by indexing, blocks in a Python loop, as community model zoos write them."""

from __future__ import annotations

import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from mxfp8_jax.bench.styles.blocks import call_block, causal, lecun_init, normal_init
from mxfp8_jax.bench.styles.config import EMBED, ONES, ZEROS, StyleConfig, fan_in


class EinsumLinear(nnx.Module):
    """``y = einsum('...i,io->...o', x, weight) + bias``."""

    PARAM_INIT: ClassVar[dict[str, tuple]] = {"weight": fan_in(-2), "bias": ZEROS}

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True, rngs: nnx.Rngs):
        self.weight = nnx.Param(lecun_init(rngs.params(), (in_features, out_features)))
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32)) if use_bias else None

    def __call__(self, x):
        y = jnp.einsum("...i,io->...o", x, self.weight[...])
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class MatmulLinear(nnx.Module):
    """``y = x @ weight`` (no bias)."""

    PARAM_INIT: ClassVar[dict[str, tuple]] = {"weight": fan_in(-2)}

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs):
        self.weight = nnx.Param(lecun_init(rngs.params(), (in_features, out_features)))

    def __call__(self, x):
        return x @ self.weight[...]


class EinsumRMSNorm(nnx.Module):
    PARAM_INIT: ClassVar[dict[str, tuple]] = {"weight": ONES}

    def __init__(self, dim: int, eps: float = 1e-6):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.weight[...]


class EinsumAttention(nnx.Module):
    """Fused q/k/v weight ``[D, 3, N, H]`` read by one einsum into ``[3, B, T, N, H]``; the
    output projection a ``MatmulLinear`` over the flattened heads."""

    PARAM_INIT: ClassVar[dict[str, tuple]] = {"wqkv": fan_in(-4)}

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.wqkv = nnx.Param(normal_init(rngs.params(), (cfg.width, 3, cfg.heads, cfg.head_dim)))
        self.o_proj = MatmulLinear(cfg.heads * cfg.head_dim, cfg.width, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = jnp.einsum("btd,dsnh->sbtnh", x, self.wqkv[...])
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(self.head_dim)
        scores = jnp.where(causal(t), scores, -1e9)
        out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)
        return self.o_proj(out.reshape(b, t, self.heads * self.head_dim))


class EinsumBlock(nnx.Module):
    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.input_layernorm = EinsumRMSNorm(cfg.width)
        self.self_attn = EinsumAttention(cfg, rngs=rngs)
        self.post_attention_layernorm = EinsumRMSNorm(cfg.width)
        self.up_proj = EinsumLinear(cfg.width, cfg.mlp, rngs=rngs)
        self.down_proj = EinsumLinear(cfg.mlp, cfg.width, rngs=rngs)

    def __call__(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.down_proj(jax.nn.gelu(self.up_proj(self.post_attention_layernorm(x))))


class EinsumModel(nnx.Module):
    """Hand-written layers in the manner of community JAX model zoos: each layer keeps raw
    ``nnx.Param`` arrays and contracts them itself (``jnp.einsum``, and ``x @ w`` in the
    attention output), an embedding table ``nnx.Param [V, D]`` read by indexing
    ``table[(tokens,)]``, an untied ``nnx.Param [D, V]`` output head applied by ``@``; blocks in
    an ``nnx.List`` run by a Python loop."""

    STYLE = "einsum"
    PARAM_INIT: ClassVar[dict[str, tuple]] = {"embed_tokens": EMBED, "lm_head": fan_in(-2)}
    DESCRIPTION = (
        "hand-written: nnx.Param layers by jnp.einsum (fused qkv [D,3,N,H], MLP) and x @ w (attn out, head); "
        "embedding table indexed table[(tokens,)]; custom RMSNorm; nnx.List + Python loop; untied head"
    )

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.remat = cfg.remat
        self.embed_tokens = nnx.Param(normal_init(rngs.params(), (cfg.vocab, cfg.width)))
        self.layers = nnx.List([EinsumBlock(cfg, rngs=rngs) for _ in range(cfg.depth)])
        self.norm = EinsumRMSNorm(cfg.width)
        self.lm_head = nnx.Param(lecun_init(rngs.params(), (cfg.width, cfg.vocab)))

    def __call__(self, tokens):
        x = self.embed_tokens[(tokens,)]
        call = nnx.remat(call_block) if self.remat else call_block
        for layer in self.layers:
            x = call(layer, x)
        return self.norm(x) @ self.lm_head[...]
