"""What every decoder family here does alike around its blocks: the tied output head, the output
path (hidden state / chunked loss / logits) and the deterministic, per-name weight init.

A family keeps its own blocks, embeddings and `initial_value` rules; these pieces only read the
attribute names the families share (`norm`, `lm_head`, `initial_value`).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from shardwise.models.common.chunked_loss import linear_cross_entropy


class TiedHead(nn.Module):
    """The output head of a model with tied embeddings: logits = h @ E^T, E the embedding table.
    A module (without parameters of its own) so that a layout can wrap the head like any
    other; the table is referenced, not registered, so it is named once, as embed_tokens."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.__dict__["embedding"] = embedding  # not a submodule: no second name for the table

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def forward(self, h_BSD: torch.Tensor) -> torch.Tensor:
        return h_BSD @ self.embedding.weight.t()


def output_head(model: nn.Module) -> nn.Module:
    """The model's head: tied to `model.embed_tokens` or a bias-free linear, as `cfg.tie_embeddings` says."""
    cfg = model.cfg
    return TiedHead(model.embed_tokens) if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)


def decoder_output(model: nn.Module, h_BSD: torch.Tensor, targets_BS: torch.Tensor | None,
                   kv_cache=None) -> torch.Tensor:
    """The end of a decoder's forward: the hidden state where a layout removed the head (a pipeline
    stage before the last), the mean cross-entropy with `targets_BS` (chunked, never holding the
    logits: models/common/chunked_loss.py), else the logits of `model.lm_head(model.norm(h))`
    (serving: only at the positions the `kv_cache`'s step asks for, `SlotKVCache.output_states`).
    On an accelerator the loss's per-chunk softmax runs compiled when the compile step compiled the
    model's blocks (`compile_blocks` sets `model.compiled_loss`): there its ~10 eager passes over fp32
    logits cost 12% of a 1B model's step (H100). Not on a CPU, where the loss is its matmuls (demo
    shape: 34.4 ms compiled vs 32.0 ms eager), and not under tensor parallelism, whose chunks
    all-reduce between their passes: there `apply_tp` sets `model.split_vocabulary`, each rank's
    share of the split head (distributed/vocab_parallel_loss.py)."""
    if model.lm_head is None:
        return h_BSD
    if targets_BS is not None:
        fused = getattr(model, "compiled_loss", False) and h_BSD.device.type != "cpu"
        return linear_cross_entropy(model.norm(h_BSD), model.lm_head.weight, targets_BS, fused=fused,
                                    split_vocabulary=getattr(model, "split_vocabulary", None))
    if kv_cache is not None:
        h_BSD = kv_cache.output_states(h_BSD)
    return model.lm_head(model.norm(h_BSD))


def build_initialised(model_class: type[nn.Module], cfg, device: torch.device | str, seed: int) -> nn.Module:
    """Build `model_class(cfg)` on meta, materialise it on `device`, initialise it from `seed`."""
    with torch.device("meta"):
        model = model_class(cfg)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


@torch.no_grad()
def init_by_name(model: nn.Module, seed: int) -> None:
    """Copy `model.initial_value(name, shape, device, seed)` into every parameter and buffer."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        tensor.copy_(model.initial_value(name, tensor.shape, tensor.device, seed))


def seeded_normal(name: str, shape, device, seed: int, std: float) -> torch.Tensor:
    """normal(0, std) drawn from a generator seeded by (seed, name): a tensor's value does not depend
    on which other parameters exist on a rank or in which order they are initialised, so a sharded
    layout computes the same full tensor and keeps its part."""
    return torch.empty(shape, device=device).normal_(0.0, std, generator=seeded_generator(name, device, seed))


def seeded_generator(name: str, device, seed: int) -> torch.Generator:
    """The generator of tensor `name`'s initial value: seeded by (seed, name) alone."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return gen
