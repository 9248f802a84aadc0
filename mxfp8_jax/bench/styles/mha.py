"""The ``"mha"`` style: stock ``nnx`` layers, blocks created stacked by ``nnx.vmap`` and run by ``nnx.scan``,
as in Flax's own NNX guides."""

from __future__ import annotations

from flax import nnx

from mxfp8_jax.bench.styles.blocks import scanned, stacked
from mxfp8_jax.bench.styles.config import StyleConfig


class MHABlock(nnx.Module):
    """Pre-LN transformer block made only of stock ``nnx`` layers."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=cfg.heads,
            in_features=cfg.width,
            qkv_features=cfg.heads * cfg.head_dim,
            decode=False,
            rngs=rngs,
        )
        self.ln2 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.fc1 = nnx.Linear(cfg.width, cfg.mlp, rngs=rngs)
        self.fc2 = nnx.Linear(cfg.mlp, cfg.width, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


class MHAModel(nnx.Module):
    """The layer-scan pattern of Flax's own NNX guides and examples: ``nnx.Embed`` tokens, blocks
    of ``nnx.LayerNorm`` -> causal ``nnx.MultiHeadAttention`` -> ``nnx.LayerNorm`` -> two
    ``nnx.Linear`` with gelu, created stacked by ``nnx.split_rngs`` + ``nnx.vmap`` and run by
    ``nnx.scan`` (``nnx.remat`` per iteration when ``cfg.remat``); final LayerNorm and an untied
    ``nnx.Linear`` head."""

    STYLE = "mha"
    DESCRIPTION = (
        "stock nnx: nnx.Embed, LayerNorm -> causal nnx.MultiHeadAttention -> LayerNorm -> 2x nnx.Linear gelu MLP; "
        "blocks vmap-stacked, run by nnx.scan (remat optional); untied nnx.Linear head"
    )

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.remat = cfg.remat
        self.embed = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
        self.blocks = stacked(MHABlock, cfg, rngs)
        self.final_norm = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.head = nnx.Linear(cfg.width, cfg.vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = scanned(self.blocks, x, self.remat, nnx.make_causal_mask(tokens))
        return self.head(self.final_norm(x))
