"""Hand-written Triton RMSNorm (forward + backward): a benchmark candidate
to compare against torch inductor. Not imported by the shardwise package.

Semantics equal the Llama composition:
    x32 = x.float()
    y = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
i.e. the normalised value is cast to x.dtype *before* the weight multiply.

Self-check on CPU:  TRITON_INTERPRET=1 python benchmarks/triton_rms_norm.py
(The Triton 3.6 interpreter truncates fp32->bf16 casts instead of rounding to
nearest-even as GPUs do, so bf16 errors there run up to ~1e-2; on a GPU, y is
expected to match eager to within an occasional 1-ulp flip.)
"""
import torch

try:
    import triton
    import triton.language as tl
    AVAILABLE = True
except ImportError:  # no triton (e.g. CPU-only install): callers must check AVAILABLE
    AVAILABLE = False

if AVAILABLE:

    @triton.jit
    def _fwd(X, W, Y, RSTD, D, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # int64: rows * D can exceed 2**31
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)  # rsqrt, as torch.rsqrt
        # Cast the normalised value to x.dtype first, as the composition does.
        xhat_c = (x * rstd).to(Y.dtype.element_ty)
        w = tl.load(W + cols, mask=mask, other=0.0)
        # A product of two bf16 values is exact in fp32, so one rounding here
        # reproduces eager's bf16 * bf16 bit for bit.
        y = w.to(tl.float32) * xhat_c.to(tl.float32)
        tl.store(Y + row * D + cols, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _bwd(X, W, G, RSTD, DX, DW_PART, n_rows, D, BLOCK: tl.constexpr,
             ROWS_PER_PROG: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        cols_ok = cols < D
        w = tl.load(W + cols, mask=cols_ok, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)  # this program's partial weight grad
        # Constexpr trip count: Triton 3.6's interpreter cannot take a runtime
        # range bound under NumPy >= 2.4. Costs one compile per distinct value.
        for i in range(ROWS_PER_PROG):
            row = pid.to(tl.int64) * ROWS_PER_PROG + i
            mask = cols_ok & (row < n_rows)  # the last program may run short
            x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(G + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row, mask=row < n_rows, other=0.0)
            xhat = x * rstd
            # dx: the cast's backward is the identity, so dx uses the fp32 xhat.
            gw = g * w
            c = tl.sum(gw * xhat, axis=0) / D
            dx = rstd * (gw - xhat * c)
            tl.store(DX + row * D + cols, dx.to(DX.dtype.element_ty), mask=mask)
            # dweight sees the normalised value *after* the cast to x.dtype.
            dw += g * xhat.to(X.dtype.element_ty).to(tl.float32)
        tl.store(DW_PART + pid * D + cols, dw, mask=cols_ok)


def _launch_cfg(D):
    block = triton.next_power_of_2(D)
    # A whole row per program: more warps for wider rows (Triton layer-norm
    # tutorial heuristic, capped at 16 rather than 8 so the backward's ~6 live
    # fp32 row vectors at D=8192 stay at 16 values/thread and don't spill).
    return block, min(max(block // 256, 1), 16)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        assert x.is_contiguous() and weight.dtype == x.dtype and weight.shape == x.shape[-1:]
        D = x.shape[-1]
        x2 = x.view(-1, D)
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block, warps = _launch_cfg(D)
        _fwd[(x2.shape[0],)](x2, weight, y, rstd, D, eps, BLOCK=block, num_warps=warps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view_as(x)

    @staticmethod
    def backward(ctx, g):
        x2, weight, rstd = ctx.saved_tensors
        n_rows, D = x2.shape
        g2 = g.contiguous().view(-1, D)
        dx = torch.empty_like(x2)
        # A fixed grid of programs, each owning a contiguous block of rows and
        # writing its own fp32 partial dweight row: deterministic, no atomics.
        sms = (torch.cuda.get_device_properties(x2.device).multi_processor_count
               if x2.is_cuda else 8)
        n_prog = max(1, min(n_rows, 4 * sms))
        rows_per_prog = triton.cdiv(n_rows, n_prog)
        n_prog = triton.cdiv(n_rows, rows_per_prog)  # drop programs with no rows
        dw_part = torch.empty(n_prog, D, dtype=torch.float32, device=x2.device)
        block, warps = _launch_cfg(D)
        _bwd[(n_prog,)](x2, weight, g2, rstd, dx, dw_part, n_rows, D,
                        BLOCK=block, ROWS_PER_PROG=rows_per_prog, num_warps=warps)
        dw = dw_part.sum(0).to(weight.dtype)
        return dx.view(g.shape), dw, None


def triton_rms_norm(x, weight, eps=1e-5):
    return _RMSNorm.apply(x, weight, eps)


def _reference(x, weight, eps=1e-5):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


if __name__ == "__main__":
    assert AVAILABLE, "triton is not installed"
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu needs TRITON_INTERPRET=1
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((8, 64), (33, 256), (5, 1000), (2, 3, 8192)):
            x = torch.randn(shape, device=dev, dtype=dtype)
            w = (1 + 0.1 * torch.randn(shape[-1], device=dev)).to(dtype)
            g = torch.randn(shape, device=dev, dtype=dtype)
            outs = []
            for fn in (_reference, triton_rms_norm):
                xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
                y = fn(xi, wi)
                y.backward(g)
                outs.append((y, xi.grad, wi.grad))
            errs = []
            for name, a, b in zip(("y", "dx", "dw"), *outs):  # a: eager, b: triton
                err = ((b.float() - a.float()).abs().max() / a.float().abs().max()).item()
                errs.append(f"{name} {err:.2e}")
            print(f"{str(dtype):15} {str(shape):12} rel max err: " + "  ".join(errs))
            tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: rounding level
            assert all(float(e.split()[1]) < tol for e in errs), "mismatch"
