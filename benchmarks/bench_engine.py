"""Engine benchmark: qkv tiled vs qkv reference vs torch SDPA, side by side in one run.

Same as ``qkv bench`` (the logic is :mod:`qkv.bench`, so an installed ``qkv bench`` has it too)::

    python benchmarks/bench_engine.py                       # N = 512 … 4096, forward, causal, backward
    python benchmarks/bench_engine.py --lengths 4096 --modes forward,causal --repeats 9
    python benchmarks/bench_engine.py --lengths 2048 --modes backward --impls tiled,torch --repeats 7
    python benchmarks/bench_engine.py --lengths 1024 --long 65536 --json engine.json --plot engine.png

Targets (float32, B=1, H=8, E=64, 2 cores): forward N=4096 ≤ 1.0× torch (causal and not), backward N=2048
≤ 1.5× torch autograd (forward + backward), N=65536 with 1 head under 2 GB peak RSS. Results: benchmarks/RESULTS.md.
"""
import sys

from qkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
