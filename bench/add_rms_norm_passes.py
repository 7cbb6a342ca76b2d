"""Fused add+RMSNorm on the H200: one pass (row held in registers) vs two passes (row
reloaded from L2) vs torch.compile, at large shapes; prints the launch config Inductor picked.

The sweep behind `cleave.kernels.rms_norm.RELOAD_MIN_ELEMENTS`: both variants here take the
hidden size as a constexpr; `one` is the one-pass kernel, `two` the reload structure with
BLOCK-wide steps. Device microseconds per call, CUDA-graph replay (bench/common.graph_call_us).

    python bench/add_rms_norm_passes.py
"""
import gc, sys
sys.path.insert(0, "bench")
import torch, triton, triton.language as tl
from common import graph_call_us
from cleave.kernels.rms_norm import fused_add_rms_norm_reference, _rms_norm_kernel

@triton.jit
def _one(x_ptr, res_ptr, w_ptr, out_ptr, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, I32: tl.constexpr):
    if I32:
        row = tl.program_id(0) * HIDDEN
    else:
        row = tl.program_id(0).to(tl.int64) * HIDDEN
    cols = tl.arange(0, BLOCK)
    m = cols < HIDDEN
    a = tl.load(x_ptr + row + cols, mask=m, other=0.0)
    b = tl.load(res_ptr + row + cols, mask=m, other=0.0)
    s = (b.to(tl.float32) + a.to(tl.float32)).to(b.dtype)
    tl.store(res_ptr + row + cols, s, mask=m)
    sf = s.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(sf * sf, axis=0) / HIDDEN + eps)
    wv = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row + cols, ((sf * rstd).to(s.dtype).to(tl.float32) * wv).to(out_ptr.dtype.element_ty), mask=m)

@triton.jit
def _two(x_ptr, res_ptr, w_ptr, out_ptr, eps, HIDDEN: tl.constexpr, BLOCK: tl.constexpr, I32: tl.constexpr):
    if I32:
        row = tl.program_id(0) * HIDDEN
    else:
        row = tl.program_id(0).to(tl.int64) * HIDDEN
    cols0 = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.range(0, HIDDEN, BLOCK):
        cols = k + cols0
        m = cols < HIDDEN
        a = tl.load(x_ptr + row + cols, mask=m, other=0.0, eviction_policy="evict_last")
        b = tl.load(res_ptr + row + cols, mask=m, other=0.0, eviction_policy="evict_last")
        s = (b.to(tl.float32) + a.to(tl.float32)).to(b.dtype).to(tl.float32)
        acc += s * s
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / HIDDEN + eps)
    for k in tl.range(0, HIDDEN, BLOCK):
        cols = k + cols0
        m = cols < HIDDEN
        a = tl.load(x_ptr + row + cols, mask=m, other=0.0, eviction_policy="evict_first")
        b = tl.load(res_ptr + row + cols, mask=m, other=0.0, eviction_policy="evict_first")
        wv = tl.load(w_ptr + cols, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
        s = (b.to(tl.float32) + a.to(tl.float32)).to(b.dtype)
        tl.store(res_ptr + row + cols, s, mask=m)
        tl.store(out_ptr + row + cols, ((s.to(tl.float32) * rstd).to(s.dtype).to(tl.float32) * wv).to(out_ptr.dtype.element_ty), mask=m)

for T, H in ((16384, 4096), (4096, 4096), (16384, 2048), (4096, 8192), (16384, 8192)):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    torch._dynamo.reset()
    comp = torch.compile(fused_add_rms_norm_reference)
    comp(x, res.clone(), w, 1e-6)
    if H == 4096 and T == 16384:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
        for obj in gc.get_objects():
            try:
                if isinstance(obj, CachingAutotuner):
                    for launcher in getattr(obj, "launchers", []):
                        print("INDUCTOR", obj.fn.__name__, launcher.config, flush=True)
            except ReferenceError:
                pass
    calls = 8 if T * H >= 1 << 26 else 32
    tc = graph_call_us([lambda: comp(x, res, w, 1e-6)] * calls, rep_ms=30)
    cur = graph_call_us([lambda: _rms_norm_kernel[(T,)](x, res, w, out, T, H, H, H, H, 1e-6, HAS_RESIDUAL=True, ROWS=1, BLOCK_H=triton.next_power_of_2(H), num_warps=8)] * calls, rep_ms=30)
    line = [f"{T}x{H}: compiled {tc:.1f} current {cur:.1f} |"]
    i32 = T * H < 2**31
    for name, kern, blocks in (("one", _one, (triton.next_power_of_2(H),)), ("two", _two, (1024, 2048, 4096))):
        for block in blocks:
            if name == "two" and block >= H: continue
            for nw in (4, 8, 16):
                fn = lambda kern=kern, block=block, nw=nw: kern[(T,)](x, res, w, out, 1e-6, HIDDEN=H, BLOCK=block, I32=i32, num_warps=nw)
                line.append(f"{name}b{block}w{nw} {graph_call_us([fn] * calls, rep_ms=30):.1f}")
    tc2 = graph_call_us([lambda: comp(x, res, w, 1e-6)] * calls, rep_ms=30)
    line.append(f"| compiled again {tc2:.1f}")
    print(" ".join(line), flush=True)
    del x, res, out
