"""Healing a replica whose state fills its memory: the previous path (the whole state packed
into a second copy on the source) against ftrun's streamed heal from 1 and from 3 sources, in
one run, on the same 4 ranks (gloo, loopback).

    python scripts/bench/bench_heal.py [--state-gb 1.5] [--chunk-mb 64]

Per path: heal seconds and GB/s (first byte asked to the state loaded), the peak extra
resident memory of the receiver (a fresh replica: model built, no optimizer state) and of the
busiest source during the heal, and the MB each source sent; then the ratios against the
previous path. Goals (issue #30): source extra <= 4 chunks; receiver extra <= its state +
4 chunks; time at one source not worse than the previous path's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-gb", type=float, default=1.5)
    ap.add_argument("--chunk-mb", type=float, default=64)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "ftrun", "--nproc", "4",
               os.path.join(HERE, "bench_heal_worker.py"), "--out", out, "--state-gb",
               str(a.state_gb), "--chunk-mb", str(a.chunk_mb)]
        subprocess.run(cmd, check=True, timeout=1200,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(os.path.join(out, "heal_bench.json")) as f:
            doc = json.load(f)
    rows, chunk = doc["rows"], doc["chunk_mb"]
    print(f"state per replica {rows[0]['state_mb']:.0f} MB, chunks of {chunk:g} MB")
    print(f"{'path':24} {'sources':>7} {'heal s':>7} {'GB/s':>6} {'receiver +MB':>13} "
          f"{'source +MB':>11}  sent MB by rank 0, 2, 3")
    for r in rows:
        print(f"{r['path']:24} {r['sources']:>7} {r['seconds']:>7.2f} {r['gb_per_s']:>6.2f} "
              f"{r['receiver_extra_mb']:>13.0f} {r['source_extra_mb']:>11.0f}  {r['sent_mb']}")
    base = rows[0]
    for r in rows[1:]:
        optimizer_mb = 2 * r["state_mb"] / 3  # what a fresh replica must allocate anyway
        beyond = (r["receiver_extra_mb"] - optimizer_mb) / chunk
        print(f"streamed from {r['sources']}: time x{r['seconds'] / base['seconds']:.2f} the "
              f"previous path's; source extra {r['source_extra_mb']:.0f} MB "
              f"({r['source_extra_mb'] / chunk:.1f} chunks; previous "
              f"{base['source_extra_mb']:.0f} MB); receiver extra "
              f"{r['receiver_extra_mb']:.0f} MB (its optimizer state {optimizer_mb:.0f} MB "
              f"+ {beyond:.1f} chunks; previous {base['receiver_extra_mb']:.0f} MB)")

if __name__ == "__main__":
    main()
