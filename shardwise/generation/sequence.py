"""A sequence the engine generates, and what one step added to it.

Torch-free (torch appears in annotations only), so that the scheduler, which reads a sequence's
slot, arrival order and how much of it is cached, imports no torch either.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from shardwise.generation.sampling import SamplingParams, TokenChoice
    from shardwise.generation.text_stream import TextStream


@dataclass
class Output:
    """What one step added to a sequence: its new token (if any), the text that became final,
    and, on the last output, why it ended ("stop", "length", "cancelled", or "error": the engine failed)."""

    sequence: "Sequence"
    token: TokenChoice | None
    text: str
    finish_reason: str | None = None


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[Output], None]
    generator: torch.Generator
    stream: TextStream
    stop_ids: frozenset[int]
    id: int = 0  # arrival order: the scheduler prefills in it
    slot: int | None = None
    num_cached: int = 0  # positions whose keys/values are in the slot
    num_reused: int = 0  # of them, prompt tokens copied from the prefix cache instead of computed
    position_offset: int = 0  # cached tokens before the decoder's position 0: an encoder-decoder's prompt
    output_ids: list[int] = field(default_factory=list)
    counts: torch.Tensor | None = None
    finish_reason: str | None = None
    error_id: str | None = None  # finish_reason "error": the id of the failure in the server log
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    speculation: object | None = None  # speculation.SequenceSpeculation, when the engine speculates

    @property
    def text(self) -> str:
        """The output text so far (all of it once finished; stop strings cut it)."""
        return self.stream.text

    @property
    def prefilling(self) -> bool:
        return self.num_cached < len(self.prompt_ids)
