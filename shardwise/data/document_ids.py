"""Document ids for the windows of a text stream (data.document_mask): Llama 3's practice of keeping
each token's attention within its own document when documents are concatenated for pretraining.

The stream holds every document followed by end-of-text (data/prepare.py). In a window, a new
document starts after each end-of-text input token, so the end-of-text token belongs to the document
it ends; ids count from 0 in every window. Targets are the stream's, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch


def document_ids_of(inputs_BS: torch.Tensor, eos_id: int) -> torch.Tensor:
    """int64 [B, S]: the document of each input token (a new one after each end-of-text token)."""
    ends = (inputs_BS == eos_id).to(torch.int64)
    return torch.cumsum(ends, dim=1) - ends


@dataclass(frozen=True)
class WithDocumentIds:
    """An objective's (inputs, targets) maker that adds the inputs' document ids."""

    make_pair: Callable
    eos_id: int

    def __call__(self, windows_BS1: torch.Tensor, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
        inputs, targets = self.make_pair(windows_BS1, samples)
        return inputs, targets, document_ids_of(inputs, self.eos_id)
