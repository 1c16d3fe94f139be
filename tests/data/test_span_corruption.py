"""T5's span corruption (`data/objectives.py`): the input with sentinels in place of the hidden spans,
and the targets spelling each sentinel and its span, give back the window's tokens exactly;
`data.length_multiple` rounds both lengths (for sequence parallelism) without changing that."""

import numpy as np
import pytest
import torch

from shardwise.data.objectives import IGNORE_INDEX, SPAN_LENGTH, SpanCorruption

SENTINELS = tuple(range(1, 33))
EOS = 0


def rebuilt(inputs: list[int], targets: list[int]) -> list[int]:
    """The window the pair came from: each sentinel of the input replaced by its span."""
    spans, current = {}, None
    for token in targets:
        if token in SENTINELS:
            current = spans.setdefault(token, [])
        elif token not in (EOS, IGNORE_INDEX):
            current.append(token)
    assert inputs[-1] == EOS and EOS in targets
    return [t for token in inputs[:-1] for t in (spans[token] if token in SENTINELS else [token])]


@pytest.mark.parametrize("multiple", [1, 2, 4])
def test_spans_hide_and_spell_the_window(multiple):
    seq_len, samples = 64, np.arange(5)
    windows = torch.from_numpy(np.random.default_rng(0).integers(100, 500, (5, seq_len + 1)))
    corrupt = SpanCorruption(SENTINELS, EOS, fraction=0.15, seed=0, multiple=multiple)
    inputs, targets = corrupt(windows, samples)
    spans = corrupt.num_spans(seq_len)  # round(0.15 * 64 / 3) = 3
    assert spans == 3
    assert inputs.shape[1] % multiple == 0 and targets.shape[1] % multiple == 0
    assert seq_len - 2 * spans + 1 - multiple < inputs.shape[1] <= seq_len - 2 * spans + 1
    spelled = spans * (SPAN_LENGTH + 1) + 1
    assert spelled <= targets.shape[1] < spelled + multiple
    assert (targets[:, spelled:] == IGNORE_INDEX).all()  # the padding is ignored by the loss
    used = inputs.shape[1] - 1 - spans + spans * SPAN_LENGTH  # the window's tokens the pair covers
    for row in range(5):
        assert rebuilt(inputs[row].tolist(), targets[row].tolist()) == windows[row, :used].tolist()
