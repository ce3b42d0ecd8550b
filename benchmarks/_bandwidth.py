"""Device memory bandwidth for rooflines, measured in the same run as the figure it judges.

A decode step is bound by the bytes it must READ (weights + KV), so its roofline uses the
device's read bandwidth, measured with read-only kernels (one value written per block):
the better of torch's sum reduction and a Triton streaming read. Half of a copy's
read + write figure is not a read bandwidth: a copy both reads and writes every byte and
reaches about half of a read-only stream's rate per direction (on an H200: ~2.1 vs
~4.4 TB/s).
"""

from __future__ import annotations

import time

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: str, iters: int) -> float:
    fn()
    _sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / iters


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Copy bandwidth in bytes/s, read + write counted (reported beside the read figure)."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() / _timed(lambda: b.copy_(a), device, 5)


def _triton_read(x: torch.Tensor):
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        base = pid.to(tl.int64) * BLOCK * ITERS
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + pid, tl.sum(acc))

    block, iters = 4096, 16
    grid = (triton.cdiv(x.numel(), block * iters),)
    out = torch.empty(grid[0], dtype=torch.float32, device=x.device)
    return lambda: read_kernel[grid](x, out, x.numel(), BLOCK=block, ITERS=iters)


def read_bandwidth(device: str, nbytes: int = 4 << 30) -> dict[str, float]:
    """Read-only bandwidth in bytes/s: ``{"torch_sum": ..., "triton_read": ..., "best": ...}``
    (Triton's entry only where it runs)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    out = {"torch_sum": nbytes / _timed(lambda: x.sum(), device, 10)}
    if device == "cuda":
        try:
            out["triton_read"] = nbytes / _timed(_triton_read(x), device, 10)
        except Exception:  # noqa: BLE001 (Triton missing or failing: torch's figure stands)
            pass
    out["best"] = max(out.values())
    return out


def graph_time(fn, reps: int = 20) -> float:
    """Seconds one call of ``fn`` (itself many kernels) takes, from a CUDA graph's replays (the
    host's launches do not bound it). CUDA only."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps
