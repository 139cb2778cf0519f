"""The probe of a new build: `python -m engine.kernels.probe LIBRARY.so`, run by engine/kernels/build.py in a
child process before the engine loads the library itself. It loads the library and calls each op on
small inputs, printing each op's name before its call, so a child that dies (SIGILL where the CPU reports
an instruction set its hypervisor turned off, a segfault) names the op it died in; it exits 1 where an
op's values are not its reference's. BATCHSCOPE_PROBE_FAULT=SIGILL (or another signal's name) makes the
child die so at the first op: the tests' way to see that the engine then takes the plain path."""
from __future__ import annotations

import os
import signal
import sys

import torch


def close(name: str, got, want, tol: float):
    if not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
        sys.exit(f"{name}: {float((got.float() - want.float()).abs().max())} from the reference")


def main(path: str):
    os.environ["BATCHSCOPE_CPU_KERNEL_PATH"] = path
    from engine.kernels import cpu_kernels as k
    from engine.kernels import ops
    from engine.kernels import reference as ref
    if k.library() is None:
        sys.exit("the library did not load")
    g = torch.Generator().manual_seed(0)
    fault = os.environ.get("BATCHSCOPE_PROBE_FAULT")
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        r = lambda *s: torch.randn(*s, generator=g).to(dtype)       # noqa: E731
        print(f"rms_norm {dtype}", flush=True)
        if fault:
            signal.raise_signal(getattr(signal, fault))
        x, w = r(3, 64), r(64)
        close("rms_norm", ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), tol)
        print(f"silu_and_mul {dtype}", flush=True)
        gu = r(3, 128)
        close("silu_and_mul", ops.silu_and_mul(gu, 64), ref.silu_and_mul(gu, 64), tol)
        print(f"rope {dtype}", flush=True)
        qk, cos, sin = r(3, 4, 64), r(3, 1, 64), r(3, 1, 64)
        close("rope", ops.rope(qk, cos, sin), ref.apply_rope(qk, cos, sin), tol)
        print(f"write_kv, paged_decode {dtype}", flush=True)
        kc, vc = torch.zeros(4, 16, 2, 64, dtype=dtype), torch.zeros(4, 16, 2, 64, dtype=dtype)
        kv, slots = r(5, 2, 64), torch.tensor([0, 1, 2, 17, 18])
        ops.write_kv(kv, kv, kc, vc, slots)
        q, tables, lens = r(2, 4, 64), torch.tensor([[0, 2], [1, 0]]), torch.tensor([3, 3])
        close("paged_decode", ops.paged_decode(q, kc, vc, tables, lens), ref.paged_decode(q, kc, vc, tables, lens), tol)
        if k.avx512():
            print(f"causal_prefill {dtype}", flush=True)
            q, kk = r(6, 4, 64), r(6, 2, 64)
            close("causal_prefill", ops.causal_prefill_or_none(q, kk, kk, 2), ref.causal_prefill(q, kk, kk, 2), tol)
    if k.f32_kernel():
        print("pack_f32, linear_f32", flush=True)
        x, w = torch.randn(3, 40, generator=g), torch.randn(48, 40, generator=g)
        close("linear_f32", ops.linear_f32(x, ops.pack_f32(w), 48), ref.linear(x, w), 1e-4)
    if k.amx_bf16():
        print("pack_amx, linear_amx", flush=True)
        x, w = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(48, 64, generator=g).bfloat16()
        close("linear_amx", ops.linear_amx(x, ops.pack_amx(w), 48), ref.linear_tiles(x, w), 1e-2)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
