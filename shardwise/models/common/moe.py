"""Mixture of experts (Shazeer et al., 2017; Switch, Fedus et al., 2021; Mixtral; DeepSeek-V3):
a drop-in replacement for the SwiGLU MLP of a block.

    scores  = softmax(x W_r^T)  or  sigmoid(x W_r^T)              router, [N, E], fp32
    experts = top-k of (scores + b)   (b: aux-loss-free bias, selection only, DeepSeek-V3)
    weights = scores[experts], renormalised to sum 1 when router_norm_topk
    y       = sum_j weights_j * SwiGLU_{experts_j}(x) + shared(x)   [* sigmoid(x w_s) for Qwen2-MoE]

Experts are computed batched: the N*k (token, expert) assignments are sorted by expert (a
stable sort, so each expert sees its tokens in order), and one grouped matmul runs every
expert on its contiguous segment. The grouped matmul is `torch._grouped_mm` where a probe
shows it works forward and backward for the device and dtype (torch 2.13 CPU fp32 does) and the
widths are multiples of 16 bytes (its stride rule); elsewhere a loop over the *experts* (E matmuls on slices of the sorted tokens; never a loop
over tokens). Both give the same result to fp32 rounding.

A compiled forward without gradients (the serving engine's decode step) takes `every_expert`
instead: every expert over every row, weighted by the router (0 where not chosen or dropped), with
static shapes, so the step compiles whole; over a decode step's few rows the E/k times more
multiplies cost less than the dispatch's data-dependent graph breaks did.

Capacity (capacity_factor c > 0): each expert takes at most C = ceil(c * N * k / E)
assignments of the N tokens in this call, the first C in token order; the rest are dropped
(their weight contributes nothing; the token keeps its residual). c = 0 is dropless.

Auxiliary losses, per call (N tokens, a_e = assignments to expert e before dropping,
P_e = mean over tokens of the router probabilities, normalised to sum 1 for sigmoid scores):
    load balance  L_aux = E / (N k) * sum_e a_e P_e      (Switch eq. 4; 1 when perfectly uniform)
    router z-loss L_z   = mean_tokens logsumexp(logits)^2 (ST-MoE eq. 5)
`aux_loss_coef * L_aux + z_loss_coef * L_z` is added to the training loss without the trainer's
loss function knowing: `AuxLossScaler` is the identity on the layer's output in forward and, in
backward, also back-propagates the aux loss times `aux_loss_scale` (set from outside to the
trainer's 1/micro-batches scaling of the main loss), as Megatron's MoEAuxLossAutoScaler does.
That works unchanged under pipeline stages, where the loss exists only on the last stage.
The values are recorded in `stats` (detached, summed over calls) for the step's metrics.

Nothing here knows about distribution: expert parallelism replaces `GroupedExperts.forward`
from outside (shardwise.distributed.expert_parallel), and sums `stats` over ranks.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.common.mlp import SwiGLU

STAT_KEYS = ("tokens", "dropped", "assigned", "aux_loss", "z_loss", "calls")


# -- grouped matmul ----------------------------------------------------------------------------


class _ContiguousGrad(torch.autograd.Function):
    """Identity; makes the incoming gradient contiguous (`_grouped_mm`'s backward refuses the
    stride-0 gradients that e.g. `.sum().backward()` produces)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _segment_matmul(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The fallback: one matmul per expert on its segment of the sorted rows."""
    parts = [seg @ w_EDF[e] for e, seg in enumerate(x_ND.split(counts))]
    return torch.cat(parts) if parts else x_ND.new_zeros(0, w_EDF.shape[-1])


@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Does `torch._grouped_mm` run (forward and backward) and agree with the segment loop here?"""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        # with gradients whatever the first caller's mode: probed in inference mode, the backward
        # failed and the answer (cached) was False for the process, so the path taken depended on
        # which forward came first. Its own saved tensors stay its own: the first call may come inside
        # a recomputed block, whose checkpoint would otherwise count them in the forward and find them
        # missing from the recomputation (a fresh process with train.recompute = "full" stopped there)
        with torch.inference_mode(False), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor):
            return _grouped_mm_probe(device_type, dtype)
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _grouped_mm_probe(device_type: str, dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=gen).to(device_type, dtype).requires_grad_()
    w = torch.randn(3, 16, 16, generator=gen).to(device_type, dtype).requires_grad_()
    offsets = torch.tensor([2, 2, 6], dtype=torch.int32, device=device_type)
    y = _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offsets))
    y.sum().backward()
    expected = _segment_matmul(x.detach(), w.detach(), [2, 0, 4])
    return bool(torch.allclose(y.detach().float(), expected.float(), rtol=1e-2, atol=1e-2)) and w.grad is not None


def _aligned(x_ND: torch.Tensor, w_EDF: torch.Tensor) -> bool:
    """`_grouped_mm` needs row strides that are multiples of 16 bytes."""
    return all(size * x_ND.element_size() % 16 == 0 for size in (x_ND.shape[1], w_EDF.shape[2]))


def grouped_matmul(x_ND: torch.Tensor, w_EDF: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by expert, `counts[e]` of them for expert e: y[rows of e] = x[rows of e] @ w[e]."""
    if torch.is_autocast_enabled(x_ND.device.type):
        dtype = torch.get_autocast_dtype(x_ND.device.type)
        x_ND, w_EDF = x_ND.to(dtype), w_EDF.to(dtype)
    elif w_EDF.dtype != x_ND.dtype:
        w_EDF = w_EDF.to(x_ND.dtype)
    if x_ND.shape[0] > 0 and _aligned(x_ND, w_EDF) and grouped_mm_works(x_ND.device.type, x_ND.dtype):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x_ND, w_EDF, offs=offsets))
    return _segment_matmul(x_ND, w_EDF, counts.tolist())


def grouped_swiglu(x_ND, counts_E, w_gate_EDF, w_up_EDF, w_down_EFD) -> torch.Tensor:
    """SwiGLU of each expert on its segment of the sorted rows."""
    hidden = F.silu(grouped_matmul(x_ND, w_gate_EDF, counts_E)) * grouped_matmul(x_ND, w_up_EDF, counts_E)
    return grouped_matmul(hidden, w_down_EFD, counts_E)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: gate/up [E, dim, hidden], down [E, hidden, dim]
    (input-major, so a segment's rows multiply the expert's matrix directly)."""

    data_dependent = True
    """Its work depends on the routing's counts (segment sizes, capacity drops): regional
    compilation compiles around it (compile/regional.py), and the MoE forward that dispatches
    to it stays eager."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.up_proj = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))

    def expert_weights(self) -> tuple[torch.Tensor, ...]:
        """The stacked weights, leading dim the expert (what expert parallelism shards)."""
        return self.gate_proj, self.up_proj, self.down_proj

    @staticmethod
    def compute(x_sorted_ND: torch.Tensor, counts_E: torch.Tensor, weights) -> torch.Tensor:
        """The experts on rows sorted by expert (`counts_E` rows each), with `weights` as
        `expert_weights()` orders them (local shards under expert parallelism)."""
        return grouped_swiglu(x_sorted_ND, counts_E, *weights)

    def forward(self, x_sorted_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        return self.compute(x_sorted_ND, counts_E, self.expert_weights())


# -- routing -----------------------------------------------------------------------------------


class Router(nn.Module):
    """Scores every expert for every token and picks the top k."""

    def __init__(self, dim: int, n_experts: int, *, top_k: int, score: str, norm_topk: bool, with_bias: bool):
        super().__init__()
        self.top_k, self.score, self.norm_topk = top_k, score, norm_topk
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        # Aux-loss-free balancing: a per-expert bias added for selection only, moved by a rule
        # from the load (not by gradients); a buffer, so checkpoints carry it.
        if with_bias:
            self.register_buffer("score_bias", torch.zeros(n_experts))
        else:
            self.score_bias = None

    def forward(self, x_ND: torch.Tensor):
        """(logits [N, E] fp32, scores [N, E], expert ids [N, k], weights [N, k] fp32)."""
        logits = F.linear(x_ND, self.weight).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        select = scores if self.score_bias is None else scores + self.score_bias
        expert_ids = select.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, expert_ids)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, scores, expert_ids, weights


def load_balance_loss(scores_NE: torch.Tensor, counts_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch's E / (N k) * sum_e a_e P_e (a_e counts, a constant; P_e mean normalised scores)."""
    num_tokens, num_experts = scores_NE.shape
    probs = scores_NE / scores_NE.sum(-1, keepdim=True)
    return num_experts / (num_tokens * top_k) * (counts_E.to(probs.dtype) * probs.mean(0)).sum()


def z_loss(logits_NE: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits_NE, dim=-1).pow(2).mean()


def recomputing() -> bool:
    """True while autograd runs a backward pass: activation recomputation runs the forward again
    there (torch stops it early, at the last saved tensor it needs, which today comes before the
    statistics; this keeps a second run from counting them twice whatever the order)."""
    return torch._C._current_graph_task_id() != -1


class AuxLossScaler(torch.autograd.Function):
    """y = x in forward; in backward dL/dx = dL/dy and d/d(aux) = scale, i.e. the gradient of
    `scale * aux` is added to whatever loss the output feeds."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out, torch.full(ctx.aux_shape, ctx.scale, device=grad_out.device, dtype=torch.float32), None


def capacity(num_assignments: int, n_experts: int, factor: float) -> int:
    """Slots per expert: ceil(factor * N k / E)."""
    return math.ceil(factor * num_assignments / n_experts)


def dispatch_order(expert_ids_NK: torch.Tensor, n_experts: int, capacity_factor: float):
    """Sort the N*k assignments by expert (stable: token order inside an expert) and drop those
    past an expert's capacity. Returns (kept assignment indices into the flattened [N*k], in
    sorted order; kept count per expert [E]; count per expert before dropping [E])."""
    flat = expert_ids_NK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    if not capacity_factor:
        return order, counts, counts
    slots = capacity(flat.numel(), n_experts, capacity_factor)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts.repeat_interleave(counts)
    keep = rank_in_expert < slots
    return order[keep], counts.clamp(max=slots), counts


class MoE(nn.Module):
    """Router + grouped experts (+ shared experts); see the module docstring."""

    def __init__(self, cfg):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.experts_per_token
        self.capacity_factor = cfg.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        self.router = Router(cfg.dim, cfg.n_experts, top_k=cfg.experts_per_token, score=cfg.router_score,
                             norm_topk=cfg.router_norm_topk, with_bias=cfg.router_bias_update_rate > 0)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, cfg.expert_ffn_dim)
        shared = cfg.shared_ffn_dim
        self.shared_experts = SwiGLU(cfg.dim, shared) if shared else None
        self.shared_gate = nn.Linear(cfg.dim, 1, bias=False) if shared and cfg.shared_expert_gate else None
        self.aux_loss_scale = 1.0
        """Set from outside to the main loss's scaling (1/micro-batches) so aux gradients match it."""
        self.stats: dict[str, torch.Tensor] = {}
        self.recording = True
        self.whole_sequence_counts = None
        """Set by a layout that splits each sequence over ranks (context parallelism): maps this
        rank's per-expert counts to (the counts over all shards of the micro-batch, number of
        shards), so the load-balancing loss is the whole micro-batch's, as in one process."""
        """False while a forward runs on something other than training data (pipeline shape inference)."""

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x = x_BSD.reshape(-1, x_BSD.shape[-1])
        logits, scores, expert_ids, weights = self.router(x)
        if torch.compiler.is_compiling() and not torch.is_grad_enabled() and not self.training:
            out = self.every_expert(x, expert_ids, weights)
            counts = kept = None
        else:
            kept, kept_counts, counts = dispatch_order(expert_ids, self.n_experts, self.capacity_factor)
            token_of = kept // self.top_k
            y_sorted = self.experts(x[token_of], kept_counts)
            weighted = y_sorted.float() * weights.reshape(-1)[kept, None]
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token_of, weighted)
            out = out.to(x.dtype)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            out = out + (torch.sigmoid(self.shared_gate(x)) * shared if self.shared_gate is not None else shared)
        if self.training:
            out = self.add_aux_losses(out, logits, scores, counts, kept.numel())
        return out.view_as(x_BSD)

    def every_expert(self, x_ND: torch.Tensor, expert_ids_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
        """The experts' sum with static shapes, for a compiled forward without gradients (the serving
        engine's decode step): every expert over every row, each row's output weighted by its router
        weight for that expert (0 where not chosen or dropped past capacity). E/k times the
        multiplies of the dispatch, over a step's few rows; the dispatch's data-dependent segment
        sizes broke the compiled graph, and the broken step decoded slower than eager (debug size:
        CPU 3.49 vs 3.06 ms, H100 18.0 vs 3.2 ms). Same sum, in fp32, as the dispatch's index_add."""
        flat = expert_ids_NK.reshape(-1)
        chosen = F.one_hot(flat, self.n_experts)  # [N*k, E]
        keep = torch.ones_like(flat, dtype=torch.bool)
        if self.capacity_factor:  # the first C assignments of each expert, in token order
            rank_in_expert = (chosen.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)
            keep = rank_in_expert < capacity(flat.numel(), self.n_experts, self.capacity_factor)
        combine_NE = (chosen * (weights_NK.reshape(-1) * keep)[:, None]).view(*expert_ids_NK.shape, -1).sum(1)
        gate, up, down = (w.to(x_ND.dtype) for w in self.experts.expert_weights())
        hidden_END = F.silu(torch.matmul(x_ND, gate)) * torch.matmul(x_ND, up)  # [E, N, F]
        y_END = torch.bmm(hidden_END, down)  # [E, N, D]
        return (y_END.float() * combine_NE.t()[:, :, None]).sum(0).to(x_ND.dtype)

    def add_aux_losses(self, out, logits, scores, counts, num_kept: int) -> torch.Tensor:
        if self.whole_sequence_counts is None:
            aux = self.aux_loss_coef * load_balance_loss(scores, counts, self.top_k)
        else:
            # L = E/(N k) sum_e a_e P_e over all N tokens of the micro-batch is bilinear in the
            # global counts a_e and the mean scores P_e; with a_e global and this shard's scores,
            # load_balance_loss / shards averages over the shards (as the gradients are) to L.
            global_counts, shards = self.whole_sequence_counts(counts)
            aux = self.aux_loss_coef * load_balance_loss(scores, global_counts, self.top_k) / shards
        z = self.z_loss_coef * z_loss(logits)
        if self.recording and not recomputing():
            self.record(tokens=counts.detach().float(), dropped=counts.sum().float() - num_kept,
                        assigned=counts.sum().float(), aux_loss=aux.detach(), z_loss=z.detach(), calls=torch.ones(()))
        if (self.aux_loss_coef or self.z_loss_coef) and torch.is_grad_enabled():
            out = AuxLossScaler.apply(out, aux + z, self.aux_loss_scale)
        return out

    def record(self, **values: torch.Tensor) -> None:
        for key, value in values.items():
            value = value.detach().float()  # stays on the device: no sync per layer
            self.stats[key] = self.stats[key] + value if key in self.stats else value

    def take_stats(self) -> dict[str, torch.Tensor]:
        """This layer's recorded sums since the last call (and reset them)."""
        stats, self.stats = self.stats, {}
        return stats

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's aux-loss-free rule: b_e += rate * sign(mean load - load_e); `load_E`
        must be the same on every replica of the router (summed over all ranks' tokens)."""
        bias = self.router.score_bias
        bias += rate * torch.sign(load_E.mean() - load_E).to(bias.device, bias.dtype)


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """The MoE layers of a model (or a pipeline stage), by module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


@contextlib.contextmanager
def stats_paused(model: nn.Module):
    """Forwards inside record no statistics."""
    layers = moe_layers(model).values()
    for layer in layers:
        layer.recording = False
    try:
        yield
    finally:
        for layer in layers:
            layer.recording = True


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    for layer in moe_layers(model).values():
        layer.aux_loss_scale = scale
