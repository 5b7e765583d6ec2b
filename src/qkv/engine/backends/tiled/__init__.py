"""The tiled backend: exact attention in blocks, never the whole ``(L, S)`` score matrix.

Forward (FlashAttention / Rabe & Staats): for a block of queries, walk the key blocks keeping, per query row,
the running max ``m_i``, the running sum ``l_i`` of ``exp(s − m_i)`` and the running weighted sum ``acc`` of
the value rows; when a later block raises the max, rescale ``l_i`` and ``acc`` by ``alpha = exp(m_old − m_new)``.
At the end ``output = acc / l_i`` and ``lse = m_i + log l_i``. Backward (FlashAttention-2): ``P`` recomputed
block by block from the saved log-sum-exp. Memory is O(block_q · block_k) per worker.

The package, one concern a module, each explaining its part:

* :mod:`~qkv.backends.tiled.plan` — the problem (validated inputs per head, the mods' traits, the limits in
  force) and the plan: the key blocks each task walks, the causal diagonal split, a block mask's grid of cells
  covered by rectangles, bands grouped to run batched;
* :mod:`~qkv.backends.tiled.scoring` — a block's scores: score mods and masks applied (ALiBi and softcap folded
  where their traits allow, any other mod called), cached patterns, softcap's polynomial;
* :mod:`~qkv.backends.tiled.forward_pass` — the online softmax of a task and its strategies, in the order they
  are tried: the compiled loop (base 2, lazy), batched bands, shift-free blocks, rescaled blocks (lazy or max
  pass); then the sinks merge and the weights pass;
* :mod:`~qkv.backends.tiled.split` — split-K for decode-like problems;
* :mod:`~qkv.backends.tiled.backward_pass` — the gradients, by key block;
* :mod:`~qkv.backends.tiled.backend` — :func:`forward`, :func:`backward`, :class:`TiledBackend`: task sizing
  and the runtime's pool;
* :mod:`~qkv.backends.tiled.thresholds` — the block sizes and thresholds (:class:`Limits`), read once per call:
  ``with limits(block_q=64, kernel_min=0): ...`` moves them for the calls inside (this thread and context).

Every strategy and kernel is counted where it runs (:mod:`qkv.paths`: ``forward.*``, ``backward.*``,
``score.*``, ``mask.*`` here, ``kernel.*`` in :mod:`qkv.kernels`). Every matmul goes through the runtime's GEMM
provider (:mod:`qkv.gemm`: NumPy's BLAS, or Intel MKL), the compiled loops through its C ``sgemm``; the
worker threads and BLAS's thread limit are the runtime's (:mod:`qkv.backends.runtime`; the thread functions
are re-exported here).

Shape legend: B batch, H query heads, Hk key/value heads, L queries, S keys, E query/key width, Ev value width.
"""
from __future__ import annotations

from qkv.engine.backends.runtime import RUNTIME, default_num_threads, get_num_threads, set_num_threads
from qkv.engine.backends.tiled import backend, backward_pass, forward_pass, plan, scoring, split, thresholds  # noqa: F401  (submodules)
from qkv.engine.backends.tiled.backend import TILED, TiledBackend, backward, forward, tiled_attention
from qkv.engine.backends.tiled.thresholds import (AUTO_MIN_KEYS, AUTO_TILED_MIN_HEAD_SCORES, AUTO_TILED_MIN_SCORES, BACKWARD_WHOLE_SCORES,
                         BAND_GROUP_SCORES,
                         BAND_KEYS_PLAIN, BAND_ROWS_PLAIN, BLOCK_K, BLOCK_K_BACKWARD, BLOCK_K_PLAIN, BLOCK_Q,
                         BLOCK_Q_BACKWARD, BLOCK_Q_PLAIN, BLOCK_Q_TILES, DIAGONAL_MIN, DIAGONAL_MIN_PLAIN,
                         GRID_CALL_COST, GRID_CALL_COST_BACKWARD, GRID_CELL, GRID_CELL_BACKWARD, GROUP_GQA,
                         LAZY_BOUND, PLAIN_LOOP, SERIAL_BELOW_FLOPS, SHIFT_FREE_BOUND, SPLIT_K_MIN_BLOCKS,
                         SPLIT_K_MIN_PART_KEYS, STRIP_ROWS_TILES, Limits, current_limits, limits)

__all__ = ["forward", "backward", "TiledBackend", "TILED", "tiled_attention", "Limits", "limits", "current_limits",
           "RUNTIME", "default_num_threads", "get_num_threads", "set_num_threads",
           "AUTO_MIN_KEYS", "AUTO_TILED_MIN_HEAD_SCORES", "AUTO_TILED_MIN_SCORES", "BACKWARD_WHOLE_SCORES",
           "BAND_GROUP_SCORES",
           "BAND_KEYS_PLAIN", "BAND_ROWS_PLAIN", "BLOCK_K", "BLOCK_K_BACKWARD", "BLOCK_K_PLAIN", "BLOCK_Q",
           "BLOCK_Q_BACKWARD", "BLOCK_Q_PLAIN", "BLOCK_Q_TILES", "DIAGONAL_MIN", "DIAGONAL_MIN_PLAIN",
           "GRID_CALL_COST", "GRID_CALL_COST_BACKWARD", "GRID_CELL", "GRID_CELL_BACKWARD", "GROUP_GQA", "LAZY_BOUND",
           "PLAIN_LOOP", "SERIAL_BELOW_FLOPS", "SHIFT_FREE_BOUND", "SPLIT_K_MIN_BLOCKS", "SPLIT_K_MIN_PART_KEYS",
           "STRIP_ROWS_TILES"]
