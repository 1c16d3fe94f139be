"""Document masks for packed batches: each token attends only the earlier tokens of its own
document (and, with a sliding window `w`, only the w latest of them, itself included), and its
position restarts at 0 where its document starts.

A row of a packed batch holds several examples (documents) back to back; `document_ids_BS` says
which document each token belongs to (ids contiguous within a row: 0, 0, 0, 1, 1, 2, ...). A
decoder builds one `DocumentMask` per forward, outside its blocks (so a compiled block receives
it as an input and nothing is rebuilt per layer), and hands it to every block's attention core,
which calls `mask.attend(q, k, v)`.

Kernels (`KERNELS`); `document_kernel` keeps the fastest per device, measured by
benchmarks/document_attention.py (docs/benchmarks.md; forward + backward of one attention call):
  sdpa    `F.scaled_dot_product_attention` with a boolean mask [B, 1, S, S] (True = attend).
          Every score is computed, masked or not. The CPU's kernel: FlexAttention has no backward
          on a CPU (torch 2.13) and its compiled forward took 1.6x SDPA's there (demo shape, 8 x 512
          tokens in documents of 64 on average: 25.8 vs 16.0 ms; forward + backward 49.8 ms against
          plain causal attention's 47.1; 2-core Xeon, 2026-11-27); the mask costs S x S bytes per row
          beside the S x S scores the kernel computes, and 0.7 ms to build once per forward.
  flex    FlexAttention (`torch.nn.attention.flex_attention`) with a block mask: blocks of
          128 x 128 scores wholly outside every document are skipped, so the work falls with the
          documents' lengths. It runs compiled (eager flex is a slow reference): `flex_attention`
          is compiled once here and inlined where the block is compiled itself. The GPU's kernel:
          on an H200 (torch 2.11, 2026-11-27) in bf16, Llama 3 1B's attention over 8 x 2048 tokens
          in documents of 256 tokens on average, 1.21 ms against SDPA with the mask 3.75 ms and
          varlen 1.91 ms, below plain causal attention's 1.44 ms (documents of 1024: 1.90, 3.74,
          2.46 ms). In fp32 32.5 ms against SDPA's 30.5 ms, its forward alone twice as fast (4.6
          vs 9.4 ms): kept for every dtype on a GPU.
  varlen  `torch.nn.attention.varlen.varlen_attn` (flash attention over the documents as one ragged
          batch; CUDA, 16-bit): measured, not picked (slower than flex above), kept for the benchmark.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from shardwise.models.common.attention import sdpa, sliding_window_mask

KERNELS = ("sdpa", "flex", "varlen")


def document_positions(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] positions that restart at 0 where each document starts (its first token in a row)."""
    batch, seq_len = document_ids_BS.shape
    index_BS = torch.arange(seq_len, device=document_ids_BS.device).expand(batch, seq_len)
    starts_BS = torch.ones_like(document_ids_BS, dtype=torch.bool)
    starts_BS[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    start_of_document_BS = torch.where(starts_BS, index_BS, 0).cummax(dim=1).values
    return index_BS - start_of_document_BS


def packed_batch(document_ids_BS: torch.Tensor, *, window: int, positions=None,
                 kv_cache=None) -> tuple[torch.Tensor, DocumentMask]:
    """A decoder's per-forward view of a packed batch: its tokens' positions [B, S] (restarting
    per document) and the `DocumentMask` every layer attends through (`window`: the model's
    sliding window), in the form its device's kernel takes."""
    if positions is not None or kv_cache is not None:
        raise ValueError(f"document_ids_BS = {list(document_ids_BS.shape)} (a packed batch) is invalid with positions_S "
                         "or a KV cache: its positions come from its document ids; pass neither with them")
    kernel = document_kernel(document_ids_BS.device)
    return document_positions(document_ids_BS), document_mask(document_ids_BS, window=window, kernel=kernel)


def document_kernel(device: torch.device) -> str:
    """The kernel a packed batch's attention runs on `device` (see the module docstring)."""
    return "flex" if device.type == "cuda" else "sdpa"


@dataclass(frozen=True, eq=False)
class DocumentMask:
    """One packed batch's attention mask in the form its kernel takes: `dense_B1SS` (sdpa),
    `block_mask` (flex) or `cu_seqlens` (varlen: the documents' cumulative lengths over the
    flattened batch). `window`: the sliding window it includes (0 = none)."""

    kernel: str
    window: int = 0
    dense_B1SS: torch.Tensor | None = None
    block_mask: object | None = None
    cu_seqlens: torch.Tensor | None = None

    def attend(self, q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d), each query over its own document's allowed keys) v."""
        if self.kernel == "sdpa":
            return sdpa(q_BHSD, k_BHSD, v_BHSD, attn_mask=self.dense_B1SS)
        if self.kernel == "flex":
            gqa = q_BHSD.shape[1] != k_BHSD.shape[1]
            return compiled("flex_attention")(q_BHSD, k_BHSD, v_BHSD, block_mask=self.block_mask, enable_gqa=gqa)
        return varlen_attention(q_BHSD, k_BHSD, v_BHSD, self.cu_seqlens, self.window)


def document_mask(document_ids_BS: torch.Tensor, *, window: int = 0, kernel: str = "sdpa") -> DocumentMask:
    """The mask of a packed batch for `kernel`: causal within each document, and (window > 0) the
    query at i attends j only if i - window < j."""
    if kernel == "sdpa":
        return DocumentMask(kernel, window, dense_B1SS=dense_document_mask(document_ids_BS, window))
    if kernel == "flex":
        return DocumentMask(kernel, window, block_mask=flex_block_mask(document_ids_BS, window))
    if kernel == "varlen":
        return DocumentMask(kernel, window, cu_seqlens=cumulative_lengths(document_ids_BS))
    raise ValueError(f"kernel = {kernel!r} is no document attention kernel; use one of {', '.join(KERNELS)}")


def dense_document_mask(document_ids_BS: torch.Tensor, window: int = 0) -> torch.Tensor:
    """[B, 1, S, S] bool, True where query s attends key t: same document, t <= s, within the window."""
    positions = torch.arange(document_ids_BS.shape[1], device=document_ids_BS.device)
    same_document_BSS = document_ids_BS[:, :, None] == document_ids_BS[:, None, :]
    return (same_document_BSS & sliding_window_mask(positions, positions, window))[:, None]


def document_mask_mod(document_ids_BS: torch.Tensor, window: int = 0):
    """The same rule as FlexAttention's `mask_mod`: (batch, head, query, key index) -> attend."""
    def allowed(b, h, q_idx, kv_idx):
        attend = (document_ids_BS[b, q_idx] == document_ids_BS[b, kv_idx]) & (kv_idx <= q_idx)
        return attend & (q_idx - kv_idx < window) if window else attend
    return allowed


def flex_block_mask(document_ids_BS: torch.Tensor, window: int = 0):
    """FlexAttention's `BlockMask` of the rule (built by the compiled `create_block_mask`)."""
    batch, seq_len = document_ids_BS.shape
    return compiled("create_block_mask")(document_mask_mod(document_ids_BS, window), batch, None, seq_len, seq_len,
                                       device=document_ids_BS.device)


COMPILED: dict = {}
"""Functions compiled once per process, by name (a plain dict: dynamo reads it inside a compiled block)."""


def compiled(name: str):
    """FlexAttention's `name` (flex_attention, create_block_mask) under torch.compile, made once."""
    if name not in COMPILED:
        from torch.nn.attention import flex_attention

        COMPILED[name] = torch.compile(getattr(flex_attention, name))
    return COMPILED[name]


def cumulative_lengths(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """int32 [documents + 1]: where each document of the flattened batch starts, then the total
    (varlen's `cu_seq`). A document never spans two rows: a row's first token starts one."""
    starts_BS = torch.ones_like(document_ids_BS, dtype=torch.bool)
    starts_BS[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    starts = starts_BS.flatten().nonzero().flatten()
    total = torch.tensor([document_ids_BS.numel()], device=starts.device)
    return torch.cat([starts, total]).to(torch.int32)


def varlen_attention(q_BHSD, k_BHSD, v_BHSD, cu_seqlens: torch.Tensor, window: int) -> torch.Tensor:
    """Flash attention over the documents as one ragged batch: [B, H, S, D] -> [B*S, H, D] and back.
    Older torch (2.11) names causality `is_causal` and has no windows nor `enable_gqa`: the kv heads
    are repeated there."""
    from torch.nn.attention.varlen import varlen_attn

    batch, _, seq_len, head_dim = q_BHSD.shape
    options = inspect.signature(varlen_attn).parameters
    gqa = q_BHSD.shape[1] != k_BHSD.shape[1]
    if gqa and "enable_gqa" not in options:
        repeats = q_BHSD.shape[1] // k_BHSD.shape[1]
        k_BHSD, v_BHSD = k_BHSD.repeat_interleave(repeats, 1), v_BHSD.repeat_interleave(repeats, 1)
    kwargs = {"enable_gqa": gqa} if "enable_gqa" in options else {}
    if "window_size" in options:
        kwargs["window_size"] = (window - 1 if window else -1, 0)
    elif window:
        raise NotImplementedError(f"this torch's varlen_attn ({torch.__version__}) has no sliding window")
    else:
        kwargs["is_causal"] = True
    q, k, v = (x.transpose(1, 2).reshape(batch * seq_len, -1, head_dim) for x in (q_BHSD, k_BHSD, v_BHSD))
    out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, seq_len, seq_len, **kwargs)
    return out.view(batch, seq_len, -1, head_dim).transpose(1, 2)
