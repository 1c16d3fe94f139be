"""Every rewrite rule, in the order they are tried (a longer pattern before one it contains)."""

from shardwise.compile.rules import add_rms_norm, rms_norm, rope, small_batch_linear, swiglu, swiglu_down

RULES = (add_rms_norm.RULE, rms_norm.RULE, swiglu_down.RULE, swiglu.RULE, rope.RULE)

DECODE_RULES = (small_batch_linear.RULE, small_batch_linear.TIED_HEAD_RULE)
"""The rules of the inference engine's compiled decode step (`generation/runner.py`), not of the
training blocks."""
