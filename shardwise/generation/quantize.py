"""Weight-only int8 and int4 quantization of a model's linears, for serving.

Schemes (weights only; activations, norms, attention and the KV cache stay as they were):
- int8: symmetric, one scale per output channel: W[n, k] ~ q[n, k] * scale[n], q in [-127, 127].
- int4: asymmetric, grouped along the input: each `group_size` input columns of an output row share a
  scale and a zero point, W[n, k] ~ (q[n, k] - 8) * scale[n, g] + zero[n, g], q in [0, 15]
  (tinygemm's convention, which `_weight_int4pack_mm` computes). Stored two codes per byte.
Scales and zero points are stored in bf16, the dtype the kernels take, so the stored weights are
exactly what the kernels multiply by (`dequantize` gives them back as floats).

Kernels: on CPU PyTorch's own, which take bf16 activations (measured here, one row times a
[2048, 2048] weight, Xeon-2-AMX, torch 2.13: fp32 dense 347 us, bf16 dense 303 us,
`_weight_int8pack_mm` 122 us with bf16 input but 1194 us with fp32 input (no fast path),
`_weight_int4pack_mm_for_cpu` 111 us bf16 but 3335 us fp32); so a quantized linear casts its input
to bf16 and its output back to the input's dtype, the rest of an fp32 model staying fp32. Elsewhere
(CUDA) gpt-fast's: int8 as `linear(x, q.to(x.dtype)) * scale`, which the compiled decode step fuses;
int4 with `_weight_int4pack_mm` on bf16 (not run here: no GPU was lent to the work that wrote it).
Above ~32 rows (a long prefill chunk) int8pack is slower than the fp32 dense product (64 rows:
3.3 ms vs 2.1 ms); decode steps, the part that reads every weight per token, have few rows.

Why int8 gains less than its halved bytes over bf16 on this CPU (measured, one row, Xeon-2-AMX,
1 thread, `benchmarks/quantize.py kernels` for the cold figures): `_weight_int8pack_mm` converts each
weight byte to fp32 and multiplies it by its scale before the FMA (four vector ops per 16 weights), and
reads 4 rows at a time with a one-line software prefetch. A [4096, 1536] weight that stays in cache runs
at 14.5 GB/s of codes (433 us; bf16 dense 1011 us, 12.4 GB/s), but a decode step reads every weight
from memory once, and from memory it streams only 5-6 GB/s of codes (1219 us; bf16 1880 us, 6.7 GB/s;
fp32 MKL on transposed storage 9.4 GB/s): 1.4-1.6x bf16 per product, not 2x. Its rows of K = 4096
stream better than those of 1536, so `Int8Linear` multiplies one row "folded", through rows 4x longer
(its docstring): +18% batch-1 decode in the engine. No other PyTorch 2.13 CPU
op multiplies int8 weights by float activations in eager mode (`_int_mm`, `onednn::qlinear_pointwise`
and fbgemm's `quantized::linear_dynamic` quantize the activations too: W8A8, another scheme); the casts
around each product (an fp32 model's activations to bf16 and back) are ~3% of a step. Compiled
(`--compile`), inductor fuses the casts into the neighbouring kernels, and with `freezing` and
`max_autotune` (CPP backend) it replaces `_weight_int8pack_mm` by its own C++ template on prepacked
codes (faster in its own autotuning: 0.116 vs 0.172 ms at [1536, 1536], 0.31 vs 0.43 ms at [4096, 1536])
while bf16 gets the AMX template: see docs/serving.md for the engine figures.

torchao (the issue asks for it where it works with the pinned torch 2.13.0+cpu), tried first:
- torchao 0.18.0 `quantize_(m, Int8WeightOnlyConfig())` works on CPU but does not use the int8
  kernel in eager mode: 827 us (fp32) / 760 us (bf16) for the product above, slower than fp32 dense.
- torchao 0.18.0 `Int4WeightOnlyConfig(group_size=128)` has no CPU path: int4_packing_format
  "plain" and "preshuffled" raise `ImportError: Requires mslk >= 1.0.0`, "plain_int32" raises
  `NotImplementedError: Int4PlainInt32Tensor does not support device 'cpu' yet`, "tile_packed_to_4d"
  raises `AssertionError: Torch not compiled with CUDA enabled`. Its CPU layout (Int4CPULayout) is gone.
- torchao 0.14.1 still has `Int4WeightOnlyConfig(layout=Int4CPULayout(), version=1)` (deprecated,
  and its C++ extensions are skipped: "incompatible torch version 2.13.0+cpu"): it works, 145 us,
  through the same `_weight_int4pack_mm_for_cpu` called here.
Its tensor subclasses would also have to pass through DTensor sharding and our DCP checkpoints.
So the aten ops are called directly, and shardwise does not depend on torchao.

The output head is quantized too, with the same scheme: at vocabulary 32000 x dim 2048 it is 6% of
a 1B model's weights, and 25% of the demo model's (4096 x 256 of 4.2M), every one read per token.
A tied head (`TiedHead`) gets a quantized copy of the embedding table: the lookups keep the float
table (they read one row per token, so it costs memory, not time).

Tensor parallelism: a quantized linear keeps the contract of the DTensor style applied to the
linear it replaces (its hooks move over): a DTensor input is used locally, and the output is a
DTensor placed as the weight's split implies (split by output features: Shard(-1); by input
features: Partial, summed by the style's output hook). Quantizing a split weight quantizes the whole
weight (one all-gather at load) and splits the codes the same way, so every rank holds what one
process would (an int8 row's scale covers the whole row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from shardwise.models.common.decoder import TiedHead

SCHEMES = ("int8", "int4")
INT4_GROUP_SIZES = (256, 128, 64, 32)
"""The group sizes `_weight_int4pack_mm(_for_cpu)` takes."""
DEFAULT_GROUP_SIZE = 128
INT4_OUT_MULTIPLE = 16
"""`_convert_weight_to_int4pack_for_cpu` takes weights whose output features are a multiple of 16."""
KERNEL_DTYPE = torch.bfloat16


def check_scheme(scheme: str, flag: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"{flag} = {scheme!r} is invalid: use int8 (per-channel) or int4 (grouped)")


def quantizable_linears(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module of every linear a scheme replaces: each `nn.Linear` and a tied head.
    Stacked expert weights (MoE) are not linears and stay float."""
    return {name: module for name, module in model.named_modules() if isinstance(module, (nn.Linear, TiedHead))}


def local_shape(weight: torch.Tensor) -> tuple[int, int]:
    return tuple((weight.to_local() if isinstance(weight, DTensor) else weight).shape)


def choose_group_size(model: nn.Module, scheme: str, group_size: int | None, flag: str = "--group-size") -> int:
    """The int4 group size to use (0 for int8): `group_size`, checked against every linear (each rank's
    share of it under tensor parallelism), or without one the largest kernel size up to 128 that fits."""
    if scheme != "int4":
        return 0
    linears = quantizable_linears(model)
    for name, module in linears.items():
        out_features, _ = local_shape(module.weight)
        if out_features % INT4_OUT_MULTIPLE:
            raise ValueError(f"--quantize = int4 is invalid for this model: {name or 'the model'} has "
                             f"{out_features} output features (per rank), and the int4 kernel takes multiples "
                             f"of {INT4_OUT_MULTIPLE}; use int8")
    if group_size is None:
        fits = [size for size in INT4_GROUP_SIZES if size <= DEFAULT_GROUP_SIZE
                and all(local_shape(m.weight)[1] % size == 0 for m in linears.values())]
        group_size = fits[0] if fits else INT4_GROUP_SIZES[-1]  # none fits: the check below names a width
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"{flag} = {group_size} is invalid: the int4 kernel takes group sizes "
                         f"{', '.join(map(str, sorted(INT4_GROUP_SIZES)))}; use one of them")
    for name, module in linears.items():
        in_features = local_shape(module.weight)[1]
        if in_features % group_size:
            raise ValueError(f"{flag} = {group_size} is invalid: it must divide every linear's input width, and "
                             f"{name} has {in_features} (per rank); use a size that divides it, e.g. "
                             f"{next((s for s in INT4_GROUP_SIZES if in_features % s == 0), 'none: use int8')}")
    return group_size


# ---- the numbers ---------------------------------------------------------------------------------

def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [N, K], scales bf16 [N]) with weight ~ codes * scales[:, None]."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-8).to(KERNEL_DTYPE)
    codes = torch.round(weight / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [N, K/2] two per byte, scales bf16 [N, K/G], zeros bf16 [N, K/G]) with
    weight[n, k] ~ (code - 8) * scale[n, k // G] + zero[n, k // G]."""
    num_out, num_in = weight.shape
    groups = weight.float().reshape(num_out, num_in // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-8).to(KERNEL_DTYPE)
    zeros = (low + 8 * scales.float()).to(KERNEL_DTYPE)  # the value of code 8: tinygemm's zero point
    codes = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None]) + 8
    codes = codes.clamp(0, 15).to(torch.uint8).reshape(num_out, num_in)
    return codes[:, 0::2] << 4 | codes[:, 1::2], scales, zeros


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] codes (int32, 0..15)."""
    return torch.stack([packed >> 4, packed & 15], dim=-1).reshape(packed.shape[0], -1).to(torch.int32)


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales.float()[:, None]


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    codes = unpack_int4(packed).float()
    num_out, num_in = codes.shape
    group_size = num_in // scales.shape[1]
    groups = (codes.reshape(num_out, -1, group_size) - 8) * scales.float()[..., None] + zeros.float()[..., None]
    return groups.reshape(num_out, num_in)


# ---- the modules ---------------------------------------------------------------------------------

class QuantizedLinear(nn.Module):
    """y = x W^T (+ b) with W stored quantized (persistent buffers: what a checkpoint holds) and, after
    `prepare`, in the kernel's layout (non-persistent). Under tensor parallelism the buffers are
    DTensors split like the float weight was (`weight_placements`); the products use local shards."""

    scheme = ""

    def __init__(self, in_features: int, out_features: int, *, bias: nn.Parameter | None, mesh=None,
                 weight_placements=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.mesh, self.weight_placements = mesh, weight_placements
        self.bias = bias
        self.output_placements = None if mesh is None else (output_placement(weight_placements[0]),)

    def add_stored(self, name: str, tensor: torch.Tensor, split_dim: int | None) -> None:
        """A persistent buffer, split over the mesh along `split_dim` (None: whole on every rank)."""
        if self.mesh is not None:
            placement = Replicate() if split_dim is None else Shard(split_dim)
            tensor = distribute_tensor(tensor, self.mesh, (placement,), src_data_rank=None)
        self.register_buffer(name, tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local_x = x.to_local() if isinstance(x, DTensor) else x
        y = self.matmul(local_x.reshape(-1, local_x.shape[-1])).reshape(*local_x.shape[:-1], -1)
        if self.mesh is not None:
            y = DTensor.from_local(y, self.mesh, self.output_placements, run_check=False)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.scheme}, in_features={self.in_features}, out_features={self.out_features}"


def output_placement(weight_placement):
    """Where y = x W^T lands when W is split as `weight_placement`: by output features -> y split
    by features; by input features (x split alike) -> partial sums; whole -> whole."""
    if isinstance(weight_placement, Shard):
        return Shard(-1) if weight_placement.dim == 0 else Partial()
    return Replicate()


def split_dim_of(module: QuantizedLinear) -> int | None:
    placement = None if module.mesh is None else module.weight_placements[0]
    return placement.dim if isinstance(placement, Shard) else None


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Int8Linear(QuantizedLinear):
    """On CPU one row (a batch-1 decode step) is multiplied "folded": the codes [N, K] viewed as [N/4, 4K]
    (the same bytes) times the row placed block-diagonally in a [4, 4K] matrix, so row i of the product
    holds outputs i, i+4, ... . `_weight_int8pack_mm` reads 4 weight rows at a time and streams short
    rows poorly from memory (module docstring); 4x longer rows cost 4x the arithmetic on the zero blocks
    but measured faster where K is 1536 (cold weights, Xeon-2-AMX, 2 threads: [4096, 1536] 566 -> 492 us,
    the [32000, 1536] head 4177 -> 3692 us; at K = 4096 it was slower, 421 -> 466 us, so folding is for
    K < 4096 only; folding by 2 was slower everywhere: a 2-row block costs more arithmetic than it saves).
    The folded rows mix output channels, so the kernel gets unit scales and the scales are applied
    after, in fp32: one bf16 rounding still (the kernel's), so the same error bound."""

    scheme = "int8"
    FOLD = 4
    FOLD_BELOW_IN_FEATURES = 4096

    def store(self, weight: torch.Tensor) -> None:
        codes, scales = quantize_int8(weight)
        split = split_dim_of(self)
        self.add_stored("codes", codes, split)
        self.add_stored("scales", scales, 0 if split == 0 else None)  # per output row: whole when split by input

    def prepare(self) -> None:
        self.kernel_codes, self.kernel_scales = local(self.codes), local(self.scales)
        out_features, in_features = self.kernel_codes.shape
        self.folds = (self.kernel_codes.device.type == "cpu" and out_features % self.FOLD == 0
                      and in_features < self.FOLD_BELOW_IN_FEATURES)
        if self.folds:
            self.folded_codes = self.kernel_codes.view(out_features // self.FOLD, self.FOLD * in_features)
            self.unit_scales = torch.ones(out_features // self.FOLD, dtype=KERNEL_DTYPE)
            self.float_scales = self.kernel_scales.float()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x, self.kernel_codes.to(x.dtype)) * self.kernel_scales.to(x.dtype)
        if self.folds and x.shape[0] == 1:
            return self.folded_matmul(x)
        return torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE), self.kernel_codes,
                                                  self.kernel_scales).to(x.dtype)

    def folded_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """One row x [1, K]: y [1, N] through the folded codes (class docstring)."""
        blocks = torch.block_diag(*[x.to(KERNEL_DTYPE)] * self.FOLD)  # [FOLD, FOLD K]
        y = torch.ops.aten._weight_int8pack_mm(blocks, self.folded_codes, self.unit_scales)  # y[i, m]: output FOLD m + i
        return (y.t().reshape(1, -1).float() * self.float_scales).to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        return dequantize_int8(local(self.codes), local(self.scales))


class Int4Linear(QuantizedLinear):
    scheme = "int4"
    INNER_K_TILES = 8  # gpt-fast's choice for `_convert_weight_to_int4pack` on CUDA

    def __init__(self, *args, group_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.group_size = group_size

    def store(self, weight: torch.Tensor) -> None:
        codes, scales, zeros = quantize_int4(weight, self.group_size)
        split = split_dim_of(self)
        for name, tensor in (("codes", codes), ("scales", scales), ("zeros", zeros)):
            self.add_stored(name, tensor, split)  # a rank's input columns are whole groups (choose_group_size)

    def prepare(self) -> None:
        codes, scales, zeros = local(self.codes), local(self.scales), local(self.zeros)
        self.scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # [K/G, N, 2]
        if codes.device.type == "cpu":
            self.kernel_codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(codes), 1)
        else:
            self.kernel_codes = torch.ops.aten._convert_weight_to_int4pack(codes, self.INNER_K_TILES)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(KERNEL_DTYPE), self.kernel_codes, self.group_size,
                                                           self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x.to(KERNEL_DTYPE), self.kernel_codes, self.group_size,
                                                   self.scales_and_zeros)
        return y.to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        return dequantize_int4(local(self.codes), local(self.scales), local(self.zeros))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


# ---- the transform -------------------------------------------------------------------------------

@torch.no_grad()
def quantize_model(model: nn.Module, scheme: str, group_size: int | None = None, *,
                   group_size_flag: str = "--group-size") -> nn.Module:
    """Replace every linear (`quantizable_linears`) by its quantized form, in place, and ready the
    kernels; the model. On the meta device (a quantized run's model before its checkpoint is loaded)
    only the layout is made: `prepare_kernels` after loading. Returns the model with
    `model.quantization = (scheme, group_size)`."""
    check_scheme(scheme, "--quantize")
    group_size = choose_group_size(model, scheme, group_size, group_size_flag)
    for name, module in quantizable_linears(model).items():
        parent_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attribute, quantized_linear(module, scheme, group_size))
    model.quantization = (scheme, group_size)
    if not any(buffer.is_meta for buffer in model.buffers()):
        prepare_kernels(model)
    return model


def quantized_linear(module: nn.Module, scheme: str, group_size: int) -> QuantizedLinear:
    """`module`'s quantized replacement, with its tensor-parallel hooks (the style's input and output
    handling) moved over."""
    weight = module.weight.detach()
    mesh, placements = (weight.device_mesh, weight.placements) if isinstance(weight, DTensor) else (None, None)
    out_features, in_features = weight.shape
    bias = getattr(module, "bias", None)
    options = dict(bias=bias, mesh=mesh, weight_placements=placements)
    quantized = (Int8Linear(in_features, out_features, **options) if scheme == "int8" else
                 Int4Linear(in_features, out_features, group_size=group_size, **options))
    if weight.is_meta:
        whole = torch.empty(weight.shape, device="meta")
    else:
        whole = weight.full_tensor() if mesh is not None else weight
    quantized.store(whole)
    for hooks in ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        setattr(quantized, hooks, getattr(module, hooks))
    return quantized


def prepare_kernels(model: nn.Module) -> None:
    """Lay each quantized linear's stored codes out for its kernel (after they are loaded)."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.prepare()
