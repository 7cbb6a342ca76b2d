"""Where the host time of one small-kernel call goes (decode shapes, 1 token x 4096, bf16).

Wall-clock microseconds per call of an unsynchronised loop (`host_call_us`) for torch's eager
op, cleave's public function, and the pieces of cleave's call path one by one: allocating
the output, the specialisation key, the stream lookup, and the compiled launcher alone.

    python bench/call_overhead.py --out bench/results/kernels
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, host_call_us, run_name, write_results  # noqa: E402

from cleave.kernels import dispatch  # noqa: E402
from cleave.kernels.activation import gelu_bias  # noqa: E402
from cleave.kernels.layer_norm import _layer_norm_launcher, layer_norm  # noqa: E402
from cleave.kernels.rms_norm import fused_add_rms_norm  # noqa: E402

COLUMNS = ["what", "us"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    hidden = args.hidden
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn_like(weight)
    out = torch.empty_like(x)

    layer_norm(x, weight, bias, 1e-5)  # compile
    launch = next(iter(_layer_norm_launcher._launches.values()))
    launch_args = (x, x, weight, bias, out, 1, hidden, hidden, hidden, hidden, 1e-5)
    constexprs = (False, True, True, 1, triton.next_power_of_2(hidden))
    stream = torch._C._cuda_getCurrentRawStream(0)

    tensors, scalars = launch_args[:5], launch_args[5:]
    pointers = [tensor.data_ptr() for tensor in tensors]

    def key() -> tuple:
        ptrs = [tensor.data_ptr() for tensor in tensors]
        any(p & 15 for p in ptrs)
        return (x.get_device(), 4, constexprs, *[t.dtype for t in tensors], *map(dispatch._scalar_key, scalars))

    cases = {
        "eager F.layer_norm": lambda: F.layer_norm(x, (hidden,), weight, bias, 1e-5),
        "cleave layer_norm": lambda: layer_norm(x, weight, bias, 1e-5),
        "eager gelu(x + b)": lambda: F.gelu(x + bias),
        "cleave gelu_bias": lambda: gelu_bias(x, bias),
        "cleave fused_add_rms_norm": lambda: fused_add_rms_norm(x, residual, weight, 1e-6),
        "torch.empty [1, H]": lambda: torch.empty((1, hidden), dtype=x.dtype, device=x.device),
        "as_rows + row_launch": lambda: (dispatch.as_rows(x, None), dispatch.row_launch(1, hidden)),
        "pointers + specialisation key": key,
        "current raw stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "cached launch, int pointers": lambda: launch(1, 1, 1, stream, [*pointers, *scalars, *constexprs]),
    }
    rows = []
    for name, fn in cases.items():
        rows.append({"what": name, "us": host_call_us(fn, iters=2000, trials=7)})
        print(f"{name:32s} {rows[-1]['us']:.2f} us", flush=True)
    if args.out:
        write_results(args.out, run_name("call_overhead"), rows, COLUMNS, {"hidden": hidden})
    print(format_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
