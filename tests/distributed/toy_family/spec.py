"""The toy family's traits, as a family's `spec.py` states them (shardwise/models/<family>/spec.py)."""

from shardwise.core.family import FamilySpec

SPEC = FamilySpec(name="toy", objective="causal_lm", multi_head=True, heads_span_dim=True, layer_norm=True,
                  linear_biases=True, mlp="gelu", position_table="sequence", norm_saved_tensors=2,
                  mlp_saved_per_ffn_dim=2)
