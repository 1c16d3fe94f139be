"""The torch side of the gpt2 family: its model, its plan and its HF weight adapter."""

from shardwise.models.common.torch_family import TorchFamily
from shardwise.models.gpt2 import hf_adapter
from shardwise.models.gpt2.model import GPT2
from shardwise.models.gpt2.plan import gpt2_plan

FAMILY = TorchFamily(build=GPT2, plan=gpt2_plan, hf_adapter=hf_adapter)
