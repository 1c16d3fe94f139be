"""A second model family, deliberately unlike Llama, that gets its layouts from its plan alone; laid
out as a family folder of shardwise/models/ is (spec.py, model.py, plan.py).

Different module names everywhere (`wte`, `trunk`, `ln_out`, `unembed`; `mixer.query/key/value/
out`; `ff.expand/contract`), LayerNorm instead of RMSNorm, a GELU MLP instead of SwiGLU, learned
absolute positions instead of RoPE, an untied head. Nothing in `shardwise.distributed` knows
these names: `toy_plan` tells it.
"""

from toy_family.model import ToyConfig, ToyLM
from toy_family.plan import toy_plan
from toy_family.spec import SPEC

__all__ = ["SPEC", "ToyConfig", "ToyLM", "toy_plan"]
