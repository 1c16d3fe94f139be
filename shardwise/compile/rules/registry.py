"""Every rewrite rule, in the order they are tried (a longer pattern before one it contains)."""

from shardwise.compile.rules import add_rms_norm, rms_norm, rope, swiglu

RULES = (add_rms_norm.RULE, rms_norm.RULE, swiglu.RULE, rope.RULE)
