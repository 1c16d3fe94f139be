"""The torch side of the llama family: its model, its plan and its HF weight adapter."""

from shardwise.models.common.torch_family import TorchFamily
from shardwise.models.llama import hf_adapter
from shardwise.models.llama.model import Llama
from shardwise.models.llama.plan import llama_plan

FAMILY = TorchFamily(build=Llama, plan=llama_plan, hf_adapter=hf_adapter)
