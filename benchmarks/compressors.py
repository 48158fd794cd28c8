"""Throughput of every compressor: compress + decompress of one large float32 tensor.

Run: python benchmarks/compressors.py [--elements 16M] [--repeats 3] [--json FILE]

Reported per compressor: the median over repeats of compress + decompress time,
the throughput in dense GB/s (tensor bytes / time), and the payload's bytes.
For top-k, the time of a full ``np.sort`` of the magnitudes is printed beside
it: a selection (``np.argpartition``) must beat it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from refcoll.compressors import parse

SPECS = ["none", "fp16", "bf16", "topk:ratio=0.001", "topk:ratio=0.01", "randomk:ratio=0.01",
         "threshold:threshold=3", "qsgd:levels=16", "terngrad", "sign", "onebit",
         "powersgd:rank=4", "int8:block=256", "ef(topk:ratio=0.001)"]


def parse_count(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", default="16M")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = parse_count(args.elements)
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    # PowerSGD reads the tensor as a matrix: give it a square-ish one.
    rows = 1 << (int(np.log2(n)) // 2)
    matrix = x[: rows * (n // rows)].reshape(rows, n // rows)
    sort_s = median_time(lambda: np.sort(np.abs(x)), args.repeats)
    print(f"# {n} float32 elements ({x.nbytes / 1e6:.0f} MB), median of {args.repeats}; "
          f"np.sort of the magnitudes: {sort_s:.3f} s")
    print(f"{'compressor':<24} {'time(s)':>9} {'GB/s':>7} {'payload(B)':>12} {'ratio':>8}")
    rows_out = []
    for spec in SPECS:
        comp = parse(spec)
        tensor = matrix if spec.startswith("powersgd") else x
        state = comp.new_state(seed=0)

        def roundtrip(comp=comp, tensor=tensor, state=state):
            comp.decompress(comp.compress(tensor, state))

        seconds = median_time(roundtrip, args.repeats)
        payload = comp.compress(tensor, state).nbytes
        row = {"compressor": spec, "seconds": seconds, "gbps": tensor.nbytes / seconds / 1e9,
               "payload_bytes": payload, "ratio": tensor.nbytes / payload}
        rows_out.append(row)
        print(f"{spec:<24} {seconds:>9.3f} {row['gbps']:>7.2f} {payload:>12} {row['ratio']:>8.1f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"elements": n, "sort_seconds": sort_s, "rows": rows_out}, fh, indent=2)


if __name__ == "__main__":
    main()
