"""The merge of two partial attention outputs in one Triton kernel (imported by
kvforge.attention where Triton is installed).

dst = a * exp(la - lse) + b * exp(lb - lse), lse = log(exp(la) + exp(lb)), per
query row, in float32: one read of each input and one write, where torch
operations take two passes over a float32 accumulator and a few over the
log-sum-exps. a, b, dst: [B, H, M, d] with any strides but a contiguous last
dimension (d a power of two); dst float32 or bfloat16 and may be a; la, lb,
dst_lse: [B, H, M] float32 with a contiguous last dimension; dst_lse may be la.
"""
import torch
import triton
import triton.language as tl

BLOCK_M = 32


@triton.jit
def _merge_kernel(A, LA, Bo, LB, O, LO, H, M,
                  sab, sah, sam, sbb, sbh, sbm, sob, soh, som,
                  slab, slah, slbb, slbh, slob, sloh,
                  BLOCK: tl.constexpr, D: tl.constexpr, ROUND: tl.constexpr):
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rm = rows < M
    cols = tl.arange(0, D)
    la = tl.load(LA + b * slab + h * slah + rows, mask=rm, other=0.0)
    lb = tl.load(LB + b * slbb + h * slbh + rows, mask=rm, other=0.0)
    mx = tl.maximum(la, lb)
    ea = tl.exp(la - mx)
    eb = tl.exp(lb - mx)
    tot = ea + eb
    wa = ea / tot
    wb = eb / tot
    r64 = rows.to(tl.int64)[:, None]
    m2 = rm[:, None]
    a = tl.load(A + b * sab + h * sah + r64 * sam + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    x = tl.load(Bo + b * sbb + h * sbh + r64 * sbm + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    o = a * wa[:, None] + x * wb[:, None]
    if ROUND:
        # BF16, rounded to nearest even on the bits (as torch and kvforge round; the
        # Triton interpreter's conversion truncates), NaN kept a quiet NaN.
        u = o.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(o != o, 0x7FC0, r)
        o = r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    tl.store(O + b * sob + h * soh + r64 * som + cols[None, :], o, mask=m2)
    tl.store(LO + b * slob + h * sloh + rows, mx + tl.log(tot), mask=rm)


def merge(a, la, b, lb, dst, dst_lse):
    B, H, M, D = dst.shape
    for t in (a, b, dst):
        if t.stride(-1) != 1:
            raise ValueError("merge: the last dimension must be contiguous")
    for t in (la, lb, dst_lse):
        if t.stride(-1) != 1:
            raise ValueError("merge: the log-sum-exps' last dimension must be contiguous")
    grid = (B * H, triton.cdiv(M, BLOCK_M))
    _merge_kernel[grid](a, la, b, lb, dst, dst_lse, H, M,
                        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
                        dst.stride(0), dst.stride(1), dst.stride(2),
                        la.stride(0), la.stride(1), lb.stride(0), lb.stride(1), dst_lse.stride(0),
                        dst_lse.stride(1), BLOCK=BLOCK_M, D=D,
                        ROUND=dst.dtype != torch.float32, num_warps=4)
