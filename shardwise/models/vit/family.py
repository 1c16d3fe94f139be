"""The torch side of the vit family: its model, its plan and its HF weight adapter."""

from shardwise.models.common.torch_family import TorchFamily
from shardwise.models.vit import hf_adapter
from shardwise.models.vit.model import ViT
from shardwise.models.vit.plan import vit_plan

FAMILY = TorchFamily(build=ViT, plan=vit_plan, hf_adapter=hf_adapter)
