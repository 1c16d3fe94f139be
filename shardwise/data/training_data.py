"""The data of a training run, by its model family's objective (data/objectives.py): a token
stream for the language models (with a mask token in a trained tokenizer for a masked LM), or
labelled images for an image classifier (data/images.py); and the loaders of both splits."""

from __future__ import annotations

from shardwise.data.images import ImageSet, build_image_loaders, load_images
from shardwise.data.objectives import objective_of, pair_maker, special_tokens_of
from shardwise.data.prepare import Dataset, build_dataset
from shardwise.data.splits import build_loaders


def is_image_run(cfg) -> bool:
    return objective_of(cfg.model.family) == "image_classification"


def prepare_data(cfg, *, verify: bool = True) -> Dataset | ImageSet:
    """The run's data, from the cache when it was prepared before (text). `verify`: hash a cached
    token file against its meta.json (else only check it is unchanged since its last hash)."""
    if is_image_run(cfg):
        return load_images(cfg.data.source.strip(), cfg.data.image_pad)
    return build_dataset(cfg.data, special_tokens=special_tokens_of(cfg.model.family), verify=verify)


def build_run_loaders(cfg, data: Dataset | ImageSet, *, dp_rank: int = 0, dp_size: int = 1):
    """(training loader, validation loader or None) of this data-parallel rank."""
    if isinstance(data, ImageSet):
        return build_image_loaders(cfg, data, dp_rank=dp_rank, dp_size=dp_size)
    return build_loaders(cfg, data.tokens, dp_rank=dp_rank, dp_size=dp_size,
                         make_pair=pair_maker(cfg, data.tokenizer))
