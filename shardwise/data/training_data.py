"""The data of a training run, by data.format and its model family's objective (data/objectives.py):

    text               a token stream for the language models (with a mask token in a trained
                       tokenizer for a masked LM; data.document_mask adds document ids to its windows),
                       or labelled images for an image classifier (data/images.py)
    chat, prompt_completion, preference
                       tokenized examples with loss masks (data/example_data.py), packed or padded

and the loaders of both splits."""

from __future__ import annotations

from shardwise.data.document_ids import WithDocumentIds
from shardwise.data.example_data import ExampleSet, build_example_loaders, prepare_examples
from shardwise.data.images import ImageSet, build_image_loaders, load_images
from shardwise.data.objectives import objective_of, pair_maker, special_tokens_of
from shardwise.data.preference_loader import build_preference_loader
from shardwise.data.prepare import Dataset, build_dataset
from shardwise.data.splits import build_loaders
from shardwise.data.tokenizer import eos_id


def is_image_run(cfg) -> bool:
    return objective_of(cfg.model.family) == "image_classification"


def prepare_data(cfg, *, verify: bool = True) -> Dataset | ImageSet | ExampleSet:
    """The run's data, from the cache when it was prepared before. `verify`: hash a cached token file
    or example set against its meta.json (else only check it is unchanged since its last hash). The
    verifying call is the run's first (the launcher's, or the only process's): it prints the example
    summary (data.overlong's counts, the rows) for the run's log."""
    if is_image_run(cfg):
        return load_images(cfg.data.source.strip(), cfg.data.image_pad)
    if cfg.data.format != "text":
        return prepare_examples(cfg, verify=verify, announce=verify)
    return build_dataset(cfg.data, special_tokens=special_tokens_of(cfg.model.family), verify=verify)


def build_run_loaders(cfg, data: Dataset | ImageSet | ExampleSet, *, dp_rank: int = 0, dp_size: int = 1):
    """(training loader, validation loader or None) of this data-parallel rank."""
    if isinstance(data, ImageSet):
        return build_image_loaders(cfg, data, dp_rank=dp_rank, dp_size=dp_size)
    if isinstance(data, ExampleSet):
        if cfg.data.format == "preference":  # DPO's pairs: no validation split (Config.validate_post_training)
            return build_preference_loader(cfg, data, dp_rank=dp_rank, dp_size=dp_size), None
        return build_example_loaders(cfg, data, dp_rank=dp_rank, dp_size=dp_size)
    make_pair = pair_maker(cfg, data.tokenizer)
    if cfg.data.document_mask:
        make_pair = WithDocumentIds(make_pair, eos_id(data.tokenizer))
    return build_loaders(cfg, data.tokens, dp_rank=dp_rank, dp_size=dp_size, make_pair=make_pair)
