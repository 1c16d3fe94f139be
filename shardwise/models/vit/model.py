"""ViT (Dosovitskiy et al., 2021) as an image classifier for one device, in plain torch.nn, computing
what HF `transformers` ViTForImageClassification computes in eval mode.

The image is cut into square patches, each projected to the model width (a convolution whose kernel
and stride are the patch size); a learned class token is prepended and a learned position table
added (`PatchEmbedding`, in `models/common/patch_embedding.py`). Pre-norm blocks as GPT-2's (LayerNorm with bias, biased q/k/v/o, GELU MLP with biases), but
with bidirectional attention and the exact erf GELU. The class token's final state, normalised,
goes through a linear classifier. Module names follow the other families' (`layers`,
`attn.q_proj`, `mlp.down_proj`, `norm`); HF's names are mapped in `hf_adapter`.

As for the other families: build on the meta device, `to_empty(device=...)`, then
`init_weights(seed)`. Nothing here knows about distribution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.core.model import ModelConfig
from shardwise.models.common.attention import bidirectional_attention
from shardwise.models.common.biased_blocks import BiasedSelfAttention, layer_norm_init
from shardwise.models.common.decoder import build_initialised, init_by_name
from shardwise.models.common.mlp import GeluMLP
from shardwise.models.common.norm import LayerNorm
from shardwise.models.common.patch_embedding import PatchEmbedding


class SelfAttention(BiasedSelfAttention):
    """Bidirectional multi-head attention with biased q/k/v/o projections (HF's separate query, key,
    value and output.dense)."""

    core_attention = staticmethod(lambda q, k, v: bidirectional_attention(q, k, v))
    """softmax(q k^T / sqrt(d)) v, every patch attending every patch; a layout may swap it on an instance."""

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.attend(x_BSD, self.core_attention)


class Block(nn.Module):
    """Pre-norm, as HF's ViTLayer: h = x + attn(ln(x)); out = h + mlp(ln(h))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = LayerNorm(cfg.dim, cfg.norm_eps)
        self.attn = SelfAttention(cfg)
        self.mlp_norm = LayerNorm(cfg.dim, cfg.norm_eps)
        self.mlp = GeluMLP(cfg.dim, cfg.ffn_dim, approximate="none")  # HF's "gelu" is the exact erf GELU

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        h = x_BSD + self.attn(self.attn_norm(x_BSD))
        return h + self.mlp(self.mlp_norm(h))


class ClassTokenPool(nn.Module):
    """[B, S, D] -> [B, D], the class token's state. A module of its own, without parameters, so
    that a layout can act at the point where the head stops needing the whole sequence (sequence
    parallelism gathers the sequence before it)."""

    def forward(self, h_BSD: torch.Tensor) -> torch.Tensor:
        return h_BSD[:, 0]


class ViT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = PatchEmbedding(cfg.n_channels, cfg.image_size, cfg.patch_size, cfg.dim)
        # Keyed by layer index: names stay stable when a pipeline stage removes some layers.
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.pool = ClassTokenPool()
        # HF normalises every token and then takes token 0; LayerNorm is per token, so normalising
        # only the pooled class token gives the same logits for 1/S of the work.
        self.norm = LayerNorm(cfg.dim, cfg.norm_eps)
        self.classifier = nn.Linear(cfg.dim, cfg.n_classes)

    def forward(self, images_BCHW: torch.Tensor, targets_B: torch.Tensor | None = None) -> torch.Tensor:
        """Class logits [B, n_classes]; with `targets_B` (class indices, int64 [B]) the mean
        cross-entropy over the batch, in fp32.

        A pipeline stage may lack parts: a 3-dim input [B, S, D] is the previous stage's hidden state
        (the first stage embedded the images); without the head (`pool` removed) the output is the
        hidden state."""
        h = images_BCHW if images_BCHW.dim() == 3 else self.embed(images_BCHW)
        for block in self.layers.values():
            h = block(h)
        if self.pool is None:
            return h
        logits_BC = self.classifier(self.norm(self.pool(h)))
        if targets_B is not None:
            return F.cross_entropy(logits_BC.float(), targets_B)
        return logits_BC

    def init_weights(self, seed: int) -> None:
        """Deterministic init of every parameter from `seed` (see `initial_value`)."""
        init_by_name(self, seed)

    def initial_value(self, name: str, shape, device, seed: int) -> torch.Tensor:
        """HF ViT's init: LayerNorm weights 1, biases 0, every other weight, the class token and the
        position table normal(0, init_std), with no smaller std for the residual projections (HF's
        ViT has none). HF truncates the class token's and the table's normal at +-2 (in units, not
        std: with std 0.02 nothing is cut in practice); plain normal here."""
        return layer_norm_init(name, shape, device, seed, self.cfg.init_std)


def build_model(cfg: ModelConfig, *, device: torch.device | str = "cpu", seed: int = 0) -> ViT:
    """Build on meta, materialise on `device`, initialise from `seed`."""
    return build_initialised(ViT, cfg, device, seed)
