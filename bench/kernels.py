"""The Linear-layer kernels on this CPU: PyTorch's own (MKL sgemm) against oneDNN with prepacked weights.

    python bench/kernels.py                  # the shapes of all-MiniLM-L6-v2 at a 2,048-token batch
    python bench/kernels.py --tokens 512

Both sides run in this process, on the same inputs and threads; the last line is the ratio over the
whole set of shapes (time-weighted like one encoder layer: Q, K, V, O, FFN in and out).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedq.backends.cpu import cpu_summary
from embedq.backends.kernels import OneDNNLinear, onednn_available

# (in, out, count per encoder layer) for all-MiniLM-L6-v2: hidden 384, FFN 1536.
LAYER = [(384, 384, 4), (384, 1536, 1), (1536, 384, 1)]


def best_of(fn, repeats: int = 5, inner: int = 20) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="rows of the activation (tokens in a micro-batch)")
    args = p.parse_args()
    if not onednn_available():
        print("this PyTorch build has no oneDNN linear ops")
        return 1
    torch.manual_seed(0)
    print(f"# embedq kernels  {time.strftime('%Y-%m-%d')}  {platform.node()}  "
          f"{cpu_summary()}  cpus={os.cpu_count()}  "
          f"threads={torch.get_num_threads()}  torch={torch.__version__}  tokens={args.tokens}")
    print(f"{'shape (in -> out)':<22} {'torch ms':>9} {'GFLOP/s':>8} {'oneDNN ms':>10} {'GFLOP/s':>8} {'ratio':>6}")
    total_torch = total_onednn = 0.0
    with torch.inference_mode():
        for fin, fout, count in LAYER:
            linear = torch.nn.Linear(fin, fout).eval()
            packed = OneDNNLinear(linear)
            x = torch.randn(args.tokens, fin)
            flops = 2 * args.tokens * fin * fout
            t_torch = best_of(lambda: linear(x))  # noqa: B023
            t_onednn = best_of(lambda: packed(x))  # noqa: B023
            total_torch += count * t_torch
            total_onednn += count * t_onednn
            print(f"{f'{fin} -> {fout}':<22} {t_torch * 1e3:>9.2f} {flops / t_torch / 1e9:>8.0f} "
                  f"{t_onednn * 1e3:>10.2f} {flops / t_onednn / 1e9:>8.0f} {t_torch / t_onednn:>5.2f}x")
    print(f"oneDNN / PyTorch Linear (one encoder layer's products): {total_torch / total_onednn:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
