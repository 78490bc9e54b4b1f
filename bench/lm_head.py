"""The embedded model's Q8_0 LM head: per-channel int8 (`torch._weight_int8pack_mm`) against
the file's own int8 groups run as two int4 halves (`quant.Int8GroupLinear`), in one run.

    python bench/lm_head.py [--threads 2] [--reps 50]

The two layers are called alternately, so each finds the other's weights in the caches, as a
decode step finds the head after 30 layers of other weights. Prints ms per call at 1, 2, 4 and
7 rows (below the dense-copy threshold), and halves / per-channel as a ratio.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGUFReader

from radixserve.model.loader import default_model_path
from radixserve.model.quant import Int8GroupLinear, Int8Linear, gguf_q8_0_groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reader = GGUFReader(str(default_model_path()))
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    groups = gguf_q8_0_groups(np.asarray(tensor.data))
    layers = {
        "per-channel int8": Int8Linear(groups.dequantize(), None, torch.bfloat16),
        "Q8_0 as int4 halves": Int8GroupLinear(groups, None, torch.bfloat16),
    }
    n, k = groups.q.shape
    print(f"LM head {n} x {k}, {args.threads} threads")
    with torch.inference_mode():
        for rows in (1, 2, 4, 7):
            x = torch.randn(rows, k).bfloat16()
            times = {name: [] for name in layers}
            for _ in range(args.reps):
                for name, layer in layers.items():
                    start = time.perf_counter()
                    layer(x)
                    times[name].append(time.perf_counter() - start)
            base, new = (1e3 * float(np.median(t[2:])) for t in times.values())
            print(
                f"rows {rows}: per-channel int8 {base:.3f} ms, halves {new:.3f} ms, "
                f"ratio {new / base:.2f}"
            )


if __name__ == "__main__":
    main()
