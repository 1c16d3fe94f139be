"""Image-classification data (model.family vit): labelled images in memory, split and batched as
the token loader batches windows.

`data.source = "digits"` is scikit-learn's bundled handwritten digits (UCI optdigits test set:
1,797 grey 8x8 images of 0-9, values 0-16), read from the installed package: nothing is
downloaded. Pixels are scaled to [-1, 1] (mean 0.5, std 0.5, as HF's ViT image processor does);
data.image_pad adds background around them.

The validation split (data.val_fraction) is the last round(fraction x N) images of the file, as the
token stream's split is its end: the same at every layout and on resume. The loader is the token
loader's sampling (a seeded permutation per epoch, each data-parallel rank its contiguous slice of
the global batch, the state a step count), each sample an image instead of a window.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch

from shardwise.core.errors import invalid
from shardwise.config.schema import IMAGE_SOURCES
from shardwise.data.loader import TokenLoader, check_one_batch




@dataclasses.dataclass(frozen=True)
class ImageSet:
    images: np.ndarray
    """float32 [N, channels, height, width], scaled to [-1, 1]."""
    labels: np.ndarray
    """int64 [N], class indices."""
    num_classes: int
    source: str

    @property
    def num_images(self) -> int:
        return len(self.labels)

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256(self.images.tobytes())
        digest.update(self.labels.tobytes())
        return digest.hexdigest()

    def part(self, start: int, stop: int) -> "ImageSet":
        return dataclasses.replace(self, images=self.images[start:stop], labels=self.labels[start:stop])


def load_images(source: str, pad: int = 0) -> ImageSet:
    """The images of `source`, with `pad` background pixels (-1) added on each side (data.image_pad)."""
    if source != "digits":
        raise invalid("data.source", source, f"a ViT trains on images: use one of {', '.join(IMAGE_SOURCES)}")
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ValueError('data.source = "digits" reads scikit-learn\'s bundled images: '
                         "pip install 'shardwise[vision]' (scikit-learn)") from None
    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0 - 0.5) / 0.5
    images = np.pad(images, ((0, 0), (pad, pad), (pad, pad)), constant_values=-1.0)
    return ImageSet(images=images[:, None], labels=digits.target.astype(np.int64), num_classes=10, source=source)


def split_images(images: ImageSet, val_fraction: float) -> tuple[ImageSet, ImageSet | None]:
    """(training images, validation images or None when val_fraction is 0): the end is held out."""
    num_val = round(images.num_images * val_fraction)
    if num_val == 0:
        return images, None
    num_train = images.num_images - num_val
    return images.part(0, num_train), images.part(num_train, images.num_images)


class ImageLoader(TokenLoader):
    """The token loader's order and slicing over images: each micro-batch is (images float32
    [micro_batch_size, C, H, W], labels int64 [micro_batch_size])."""

    def __init__(self, images: ImageSet, *, global_batch_size: int, micro_batch_size: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1, seq_len: int = 0):
        self.images = images
        # seq_len (patches + class token) is recorded in the state as for text
        self.set_order(seq_len=seq_len, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                       seed=seed, dp_rank=dp_rank, dp_size=dp_size, num_windows=images.num_images,
                       make_pair=self.image_pair, data_sha256=images.sha256, data_size=images.num_images)

    def read_windows(self, windows: np.ndarray) -> np.ndarray:
        return windows

    def image_pair(self, indices: np.ndarray, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.images.images[indices]), torch.from_numpy(self.images.labels[indices])


def build_image_loaders(cfg, images: ImageSet, *, dp_rank: int = 0,
                        dp_size: int = 1) -> tuple[ImageLoader, ImageLoader | None]:
    """The training loader and, with data.val_fraction > 0, the validation loader (refused here,
    before any work, when the evaluation needs more images than the split holds)."""
    if images.num_classes > cfg.model.n_classes:
        raise invalid("model.n_classes", cfg.model.n_classes,
                      f"data.source {images.source} has {images.num_classes} classes; use model.n_classes >= "
                      f"{images.num_classes}")
    shape = images.images.shape[1:]
    want = (cfg.model.n_channels, cfg.model.image_size, cfg.model.image_size)
    if shape != want:
        raise invalid("model.image_size", cfg.model.image_size,
                      f"data.source {images.source} holds {shape[0]}-channel {shape[1]}x{shape[2]} images: use "
                      f"model.image_size = {shape[1]} and model.n_channels = {shape[0]}")
    train, val = split_images(images, cfg.data.val_fraction)
    settings = dict(seq_len=cfg.train.seq_len, global_batch_size=cfg.train.global_batch_size,
                    micro_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed, dp_rank=dp_rank,
                    dp_size=dp_size)
    if cfg.data.val_fraction and val is None:
        raise ValueError(f"data.val_fraction = {cfg.data.val_fraction} holds out none of the {images.num_images} "
                         "images; use a larger data.val_fraction")
    check_one_batch(cfg, train.num_images, f"{train.num_images} images")
    if val is None:
        return ImageLoader(train, **settings), None
    needed = cfg.train.eval_batches * cfg.train.global_batch_size
    if needed > val.num_images:
        raise invalid("train.eval_batches", cfg.train.eval_batches,
                      f"it needs {needed} images but the validation split holds {val.num_images}; use "
                      f"train.eval_batches <= {val.num_images // cfg.train.global_batch_size} or a larger "
                      "data.val_fraction")
    return ImageLoader(train, **settings), ImageLoader(val, **settings)
