"""The ``"gemma"`` style: ``nnx.Einsum`` projections, a gated MLP of raw parameters, a tied embedding,
blocks in a Python loop, as the public Gemma reference decoders write them."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from mxfp8_jax.bench.styles.blocks import call_block, causal, lecun_init, normal_init
from mxfp8_jax.bench.styles.config import ONES, StyleConfig, fan_in


class GemmaRMSNorm(nnx.Module):
    """RMS norm with its own ``scale`` parameter (multiplied in directly)."""

    PARAM_INIT: ClassVar[dict[str, tuple]] = {"scale": ONES}

    def __init__(self, dim: int, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + self.eps) * self.scale[...]


class GemmaAttention(nnx.Module):
    """Attention with ``nnx.Einsum`` projections: query kernel ``[N, D, H]``, one stacked
    key/value kernel ``[2, K, D, H]``, output kernel ``[N, H, D]`` (here ``K = N``)."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        n, d, h = cfg.heads, cfg.width, cfg.head_dim
        self.head_dim = h
        self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (n, d, h), kernel_init=lecun_init, rngs=rngs)
        self.kv_einsum = nnx.Einsum("BSD,CKDH->CBSKH", (2, n, d, h), kernel_init=lecun_init, rngs=rngs)
        self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (n, h, d), kernel_init=lecun_init, rngs=rngs)

    def __call__(self, x):
        q = self.q_einsum(x) * self.head_dim**-0.5
        k, v = self.kv_einsum(x)
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k)
        t = x.shape[1]
        logits = jnp.where(causal(t), logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1)
        encoded = jnp.einsum("BNTS,BSNH->BTNH", probs, v)
        return self.attn_vec_einsum(encoded)


class GemmaMLP(nnx.Module):
    """Gated gelu MLP kept as two raw parameters: ``gating_einsum [2, F, D]`` (gate and up
    projections stacked) contracted by ``jnp.einsum``, ``linear [F, D]`` applied by ``jnp.dot``."""

    PARAM_INIT: ClassVar[dict[str, tuple]] = {"gating_einsum": fan_in(-1), "linear": fan_in(-2)}

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.gating_einsum = nnx.Param(normal_init(rngs.params(), (2, cfg.mlp, cfg.width)))
        self.linear = nnx.Param(normal_init(rngs.params(), (cfg.mlp, cfg.width)))

    def __call__(self, x):
        gates = jnp.einsum("...D,CFD->...CF", x, self.gating_einsum[...])
        activations = nnx.gelu(gates[..., 0, :]) * gates[..., 1, :]
        return jnp.dot(activations, self.linear[...])


class GemmaBlock(nnx.Module):
    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.pre_attention_norm = GemmaRMSNorm(cfg.width)
        self.attn = GemmaAttention(cfg, rngs=rngs)
        self.pre_ffw_norm = GemmaRMSNorm(cfg.width)
        self.mlp = GemmaMLP(cfg, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.pre_attention_norm(x))
        return x + self.mlp(self.pre_ffw_norm(x))


class GemmaModel(nnx.Module):
    """A decoder in the manner of the public Gemma reference implementations: ``nnx.Einsum``
    attention projections with multi-axis (and one stacked k/v) kernels, a gated MLP of raw
    ``nnx.Param`` arrays, custom RMS norms, blocks in an ``nnx.List`` run by a Python loop. The
    embedding is tied: one ``nnx.Embed``, read by ``__call__`` (scaled by ``sqrt(width)``) on
    the way in and used by ``attend`` (``x @ table.T``) as the output head. No rotary
    embeddings (kept simple)."""

    STYLE = "gemma"
    EMBED_STD = 0.02  # the tied table is read back times sqrt(width): N(0, 1) would make every token predict itself
    DESCRIPTION = (
        "Gemma-like: nnx.Einsum q [N,D,H], stacked kv [2,K,D,H], out [N,H,D]; gated MLP of raw nnx.Param "
        "[2,F,D] (jnp.einsum) and [F,D] (jnp.dot); custom RMSNorm; nnx.List + Python loop; tied nnx.Embed (attend)"
    )

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.width, self.remat = cfg.width, cfg.remat
        self.embedder = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
        self.layers = nnx.List([GemmaBlock(cfg, rngs=rngs) for _ in range(cfg.depth)])
        self.final_norm = GemmaRMSNorm(cfg.width)

    def __call__(self, tokens):
        x = self.embedder(tokens) * jnp.sqrt(jnp.float32(self.width))
        call = nnx.remat(call_block) if self.remat else call_block
        for layer in self.layers:
            x = call(layer, x)
        return self.embedder.attend(self.final_norm(x))
