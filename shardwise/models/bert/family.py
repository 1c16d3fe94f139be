"""The torch side of the bert family: its model, its plan and its HF weight adapter."""

from shardwise.models.common.torch_family import TorchFamily
from shardwise.models.bert import hf_adapter
from shardwise.models.bert.model import Bert
from shardwise.models.bert.plan import bert_plan

FAMILY = TorchFamily(build=Bert, plan=bert_plan, hf_adapter=hf_adapter)
