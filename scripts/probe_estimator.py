"""Probe: estimator step cost, CUDA graph of eager vs torch.compile'd estimator, and a kernel breakdown."""

from __future__ import annotations

import sys
import time

import torch

from cosyvoice2.config import EngineConfig
from cosyvoice2.flow.estimator import CausalUNetEstimator
from scripts.gpu_microbench import kernel_profile


def graphed(fn, args):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*args)
    return g, out


def timeit(run, n=50):
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    cfg = EngineConfig().flow.estimator if hasattr(EngineConfig().flow, "estimator") else None
    print("estimator config", cfg, flush=True)
    with torch.device(dev):
        est = CausalUNetEstimator(cfg).to(dtype).eval()
    compiled = torch.compile(est, dynamic=False, fullgraph=True)
    modes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["default"]
    for rows, frames in ((2, 356), (10, 420), (10, 700), (32, 420)):
        x = torch.randn(rows, 80, frames, device=dev, dtype=dtype)
        mu, cond = torch.randn_like(x), torch.randn_like(x)
        mask = torch.ones(rows, 1, frames, device=dev, dtype=dtype)
        t = torch.rand(rows, device=dev, dtype=dtype)
        spks = torch.randn(rows, 80, device=dev, dtype=dtype)
        with torch.inference_mode():
            bias = est.attention_bias(mask, streaming=True)
            args = (x, mask, mu, t, spks, cond, bias)
            g, ref = graphed(est, args)
            eager_ms = timeit(lambda: est(*args), 20)
            graph_ms = timeit(g.replay)
            prof = kernel_profile(dev, g.replay)
            print(f"rows {rows:3d} frames {frames}: eager {eager_ms:7.2f} ms  graph {graph_ms:7.2f} ms  "
                  f"kernels {prof['kernels']} busy {prof['busy_ms']:.2f} ms", flush=True)
            for name, ms in prof["top"][:6]:
                print(f"        {ms:7.3f} ms {name}", flush=True)
            try:
                start = time.perf_counter()
                compiled(*args)
                torch.cuda.synchronize()
                ctime = time.perf_counter() - start
                gc, out = graphed(compiled, args)
                comp_ms = timeit(gc.replay)
                prof = kernel_profile(dev, gc.replay)
                err = (out.float() - ref.float()).abs().max().item()
                print(f"   compiled (first call {ctime:.1f} s): graph {comp_ms:7.2f} ms kernels {prof['kernels']} "
                      f"busy {prof['busy_ms']:.2f} ms  max|diff| {err:.3e}", flush=True)
                for name, ms in prof["top"][:6]:
                    print(f"        {ms:7.3f} ms {name}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print("   compile failed:", type(exc).__name__, str(exc)[:400], flush=True)


if __name__ == "__main__":
    main()
