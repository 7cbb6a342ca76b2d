"""bench/compile_log.py: how a compile's specialisation is written down."""

from __future__ import annotations

from types import SimpleNamespace

from tests.bench.bench_modules import bench_fixture

compile_log = bench_fixture("compile_log")


def test_a_compile_names_its_divisible_arguments_constants_and_pointer_types(compile_log):
    """Two compiles of one kernel may differ only in a pointer's element type (a bf16 and an
    fp8 KV cache): the words name the pointers' types, not the scalars'."""
    kernel = SimpleNamespace(name="k", jit_function=SimpleNamespace(arg_names=["cache_ptr", "n", "BLOCK"]))
    info = {"configs": [{(0,): [["tt.divisibility", 16]]}], "constants": {(2,): 64},
            "signature": {"cache_ptr": "*fp8e4nv", "n": "i32", "BLOCK": "constexpr"}}
    words = compile_log._specialisation(kernel, {"compile": info})
    assert words == "/16: cache_ptr; const: BLOCK=64; types: cache_ptr=*fp8e4nv"
