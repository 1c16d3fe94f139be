"""Patch embedding with a class token (ViT, Dosovitskiy et al., 2021; HF's `ViTEmbeddings`): an image
is cut into square patches, each projected to the model width by a convolution whose kernel and
stride are the patch size; a learned class token is prepended and a learned position table added.

Parameters `projection.weight`, `projection.bias`, `cls_token` [1, 1, dim] and `positions`
[1, num_patches + 1, dim]: a model's `initial_value` decides their init (ViT: normal(0, init_std)).
"""

from __future__ import annotations

import torch
from torch import nn


class PatchEmbedding(nn.Module):
    """images [B, C, H, W] -> [B, num_patches + 1, dim]: the patches' projections in row-major order
    after the class token, plus the position table. Only images of `image_size` are taken: the
    table has one row per patch of that size, and HF's optional interpolation of it to other sizes
    is not computed here."""

    def __init__(self, n_channels: int, image_size: int, patch_size: int, dim: int):
        super().__init__()
        self.image_shape = (n_channels, image_size, image_size)
        num_patches = (image_size // patch_size) ** 2
        self.projection = nn.Conv2d(n_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.empty(1, 1, dim))
        self.positions = nn.Parameter(torch.empty(1, num_patches + 1, dim))

    def forward(self, images_BCHW: torch.Tensor) -> torch.Tensor:
        if tuple(images_BCHW.shape[1:]) != self.image_shape:
            raise ValueError(
                f"images of shape {tuple(images_BCHW.shape)} are invalid: the model takes [batch, "
                f"{', '.join(map(str, self.image_shape))}] (model.n_channels, model.image_size); its position "
                "table has no rows for other sizes (resize the images)")
        patches_BND = self.projection(images_BCHW).flatten(2).transpose(1, 2)
        cls_B1D = self.cls_token.expand(patches_BND.shape[0], -1, -1)
        return torch.cat([cls_B1D, patches_BND], dim=1) + self.positions
