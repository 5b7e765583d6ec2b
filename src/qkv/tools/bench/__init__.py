"""Side-by-side benchmark of the engine: qkv tiled, qkv reference, torch SDPA, in one run.

For each mode (``forward``, ``causal`` forward, ``backward`` = gradients from ``grad_out``) and sequence length
N, the implementations run *interleaved* (a turn of each, repeated; a turn is a short pause, an untimed
call and a timed one) so that a noisy machine slows them alike; the table reports the median. Used by ``qkv bench`` and ``benchmarks/bench_engine.py``.

Columns: median seconds; GFLOP/s of the nominal matmul work (forward ``4·B·H·N²·E``, halved for causal;
backward ``14·B·H·N²·E``: the forward's 2 matmuls plus the backward's 5, as FlashAttention counts them);
that rate as a % of this machine's NumPy float32 matmul rate measured in the same run with the same
thread count; peak memory (growth of the peak RSS during one call, in a fresh process per cell, read from
/proc after resetting the peak; tracemalloc where /proc is missing); time relative to torch.

The GEMM provider (:mod:`qkv.gemm`): the header names the one in use, the CPU model and each provider's BLAS
kernel and measured matmul rate; ``gemms=("numpy", "mkl")`` runs the tiled engine once per provider, side by
side in the same turns (rows ``tiled (numpy)``, ``tiled (mkl)``), each row's "% matmul" against its own
provider's rate.

The modules: :mod:`._measure` (flops, matmul rates, the CPU, peak memory, the timed calls), :mod:`._env` (the
machine's record, the environment line, the header), :mod:`._sweep` (:func:`run`, :func:`long_sequence`),
:mod:`._share` (:func:`gemm_share`), :mod:`._format` (table, Markdown, plot, JSON) and :mod:`._variants`
(:func:`variants`). The public names are importable from ``qkv.bench``.
"""
from __future__ import annotations

from qkv.tools.bench._env import environment_line, header
from qkv.tools.bench._format import HEADERS, dumps, format_table, markdown, plot
from qkv.tools.bench._measure import (cpu_model, flops, gemm_info, matmul_rate, memory_in_fresh_process, peak_memory,
                                      progress_bar, provider_rates)
from qkv.tools.bench._share import gemm_share, gemm_share_lines, torch_flash_blocks
from qkv.tools.bench._sweep import IMPLS, MODES, REFERENCE_MAX_BYTES, SETTLE_S, long_sequence, run
from qkv.tools.bench._variants import (VARIANT_HEADERS, VARIANT_LONG_MB, VARIANT_TARGETS, long_window, variants,
                                       variants_markdown, variants_text)

__all__ = [
    "HEADERS", "IMPLS", "MODES", "REFERENCE_MAX_BYTES", "SETTLE_S", "VARIANT_HEADERS", "VARIANT_LONG_MB",
    "VARIANT_TARGETS", "cpu_model", "dumps", "environment_line",
    "flops", "format_table", "gemm_info", "gemm_share", "gemm_share_lines", "header", "long_sequence",
    "long_window", "markdown", "matmul_rate", "memory_in_fresh_process", "peak_memory", "plot", "progress_bar",
    "provider_rates",
    "run", "torch_flash_blocks", "variants", "variants_markdown", "variants_text",
]
