"""Direct preference optimisation (train.objective = "dpo"; Rafailov et al., 2023).

For a pair of completions of one prompt, chosen (c) and rejected (r), with log-probabilities
summed over each completion's tokens (the prompt's and the padding's targets are -100):

    loss = -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))

pi: the policy being trained, ref: the same model's initial weights. The step's loss is the mean
over the global batch's pairs: each micro-batch holds the same number of whole pairs
(data/preference_loader.py), so a micro-batch adds sum(loss) / (pairs per micro-batch x
micro-batches) and the data-parallel gradient mean completes the mean over every rank's pairs:
normalised by the global pair count, which every layout (dp, ZeRO, tp + sp, accumulation) shares
with one process. The rewards beta * (pi - ref) of chosen and rejected, their margin and the
fraction of pairs whose chosen reward is higher (accuracy) go to metrics.jsonl, as TRL logs them.

Under tensor parallelism the logits are split by vocabulary (Shard(-1)): the per-token
log-probabilities come from `F.cross_entropy(reduction="none")` under loss_parallel (the step's
`pm.loss_context()`), which all-reduces the softmax statistics without gathering the logits.
Pipeline and context parallelism are refused for DPO (Config.validate_dpo): a pair's
log-probability sums over the whole sequence, which neither layout has on one rank.

The reference log-probabilities: see train/dpo_reference.py.

Written by hand: TRL's DPOTrainer computes this loss inside a transformers/accelerate training loop
around a Hugging Face model, which a laid-out model (FSDP2, DTensor) does not run in; the loss itself
is the formula above, and tests/train/test_dpo.py checks it, its gradients and the rewards against
TRL's `DPOTrainer._compute_loss` on the same model and batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardwise.config.schema import Config
from shardwise.data.preference_loader import PairBatch
from shardwise.distributed.dims import ParallelDims
from shardwise.distributed.parallelize import ParallelModel
from shardwise.models.common.loss import autocast_context
from shardwise.models.common.moe import set_aux_loss_scale

REWARD_METRICS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")
"""What metrics.jsonl gets each DPO step: means over the global batch's pairs (TRL: rewards/chosen,
rewards/rejected, rewards/margins, rewards/accuracies)."""


def completion_logps(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Each row's sum of log p(target) over its targets that are not -100, in fp32 [B]. Under
    loss_parallel the logits are a vocabulary-sharded DTensor and so is the cross-entropy's input."""
    token_nll = F.cross_entropy(logits_BSV.float().flatten(0, -2), targets_BS.flatten(), reduction="none")
    if isinstance(token_nll, DTensor):
        token_nll = token_nll.full_tensor()
    return -token_nll.view(targets_BS.shape).sum(dim=-1)


def dpo_losses(policy_logps_2P: torch.Tensor, reference_P2: torch.Tensor,
               beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss of each pair [P], chosen rewards [P], rejected rewards [P]) of a micro-batch whose rows
    are the chosen completions then the rejected ones."""
    policy_chosen, policy_rejected = policy_logps_2P.chunk(2)
    chosen_ratio = policy_chosen - reference_P2[:, 0]
    rejected_ratio = policy_rejected - reference_P2[:, 1]
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


@dataclass
class RewardSums:
    """This rank's sums over its pairs of a step: rewards and correctly ordered pairs."""

    chosen: float = 0.0
    rejected: float = 0.0
    correct: float = 0.0
    pairs: int = 0

    def add(self, chosen_P: torch.Tensor, rejected_P: torch.Tensor) -> None:
        self.chosen += float(chosen_P.sum())
        self.rejected += float(rejected_P.sum())
        self.correct += float((chosen_P > rejected_P).sum())
        self.pairs += len(chosen_P)

    def metrics(self, dims: ParallelDims) -> dict[str, float]:
        """REWARD_METRICS over the global batch (every data-parallel rank's pairs): one all-reduce. The
        tensor-parallel ranks of a data-parallel rank hold the same sums; only the first adds them."""
        sums = torch.tensor([self.chosen, self.rejected, self.correct, self.pairs], dtype=torch.float64)
        if dims.is_distributed:
            if dist.get_rank() % dims.tp:  # tp is the innermost mesh axis
                sums.zero_()
            dist.all_reduce(sums)
        chosen, rejected, correct, pairs = (float(value) for value in sums)
        return {"reward_chosen": chosen / pairs, "reward_rejected": rejected / pairs,
                "reward_margin": (chosen - rejected) / pairs, "reward_accuracy": correct / pairs}


def dpo_forward_backward(pm: ParallelModel, micro_batches: list[PairBatch], cfg: Config,
                         device) -> tuple[float, RewardSums]:
    """Gradients of the mean DPO loss over this rank's pairs; (that mean, the rewards' sums)."""
    total, rewards = 0.0, RewardSums()
    count = len(micro_batches)
    set_aux_loss_scale(pm.model, 1 / count)
    for index, batch in enumerate(micro_batches):
        assert batch.reference_P2 is not None, "DPO batches need the reference log-probabilities first"
        is_last = index == count - 1
        with pm.sync.micro_batch(is_last), pm.loss_context():
            with autocast_context(device, cfg.train.autocast_dtype):
                logits = pm.module(batch.inputs_BS.to(device))
            logps = completion_logps(logits, batch.targets_BS.to(device))
            losses, chosen, rejected = dpo_losses(logps, batch.reference_P2.to(device), cfg.train.dpo_beta)
            loss = losses.sum() / (len(losses) * count)
            loss.backward()
        pm.sync.after_backward(is_last)
        total += float(loss.detach())
        rewards.add(chosen, rejected)
    return total, rewards

