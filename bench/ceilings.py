"""The two ceilings of the device at hand (METHOD.md): the dense bf16 GEMM
rate (8192^3 through torch/cuBLAS, random data) and the device-to-device copy
bandwidth (bytes read + written), and the write-only bandwidth (a fill: the
ceiling of kernels whose traffic is mostly stores, like the down-projection's
Y). Used for the per-kernel rooflines in bench/RESULTS.md.
python3 bench/ceilings.py"""
import statistics

import torch


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e-3)
    return statistics.median(ts)


def main():
    n = 8192
    a = torch.randn(n, n, device="cuda").bfloat16()
    b = torch.randn(n, n, device="cuda").bfloat16()
    t = timed(lambda: a @ b)
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    tc = timed(lambda: dst.copy_(src))
    tw = timed(lambda: dst.fill_(7))
    print(f"{torch.cuda.get_device_name()}: dense bf16 GEMM {2 * n**3 / t / 1e12:.0f} TFLOPS, "
          f"copy {2 * src.numel() / tc / 1e12:.2f} TB/s, write-only {dst.numel() / tw / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
