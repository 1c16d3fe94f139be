"""Preference rows for the DPO tests (tests/train/test_dpo.py, tests/distributed/test_dpo_layouts.py): a
JSONL file of `prompt`, `chosen`, `rejected` strings, and the overrides of a tiny DPO run on it.
Imported by name: tests/ is on sys.path (its conftest.py lives there).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def write_preference_rows(path: Path, num_rows: int = 24, seed: int = 0) -> Path:
    """Rows whose chosen reply continues the prompt's words in order and whose rejected reply repeats
    its first word: something a tiny model can learn to prefer in a few steps."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        start = rng.randrange(len(WORDS) - 8)
        prompt = " ".join(WORDS[start:start + 3])
        chosen = " ".join(WORDS[start + 3:start + 3 + rng.randrange(2, 5)])
        rejected = " ".join([WORDS[start]] * rng.randrange(2, 6))
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dpo_overrides(data_file: Path) -> dict:
    """What turns a tiny parity run (tests/distributed/harness.py `layout`) into DPO on `data_file`."""
    return {"data.source": str(data_file), "data.format": "preference", "data.vocab_size": 300,
            "train.objective": "dpo", "train.dpo_beta": 0.5}
