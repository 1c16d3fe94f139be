"""The torch side of the t5 family: its model, its plan and its HF weight adapter."""

from shardwise.models.common.torch_family import TorchFamily
from shardwise.models.t5 import hf_adapter
from shardwise.models.t5.model import T5
from shardwise.models.t5.plan import t5_plan

FAMILY = TorchFamily(build=T5, plan=t5_plan, hf_adapter=hf_adapter)
