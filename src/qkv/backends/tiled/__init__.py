"""The tiled backend: exact attention in blocks, never the whole ``(L, S)`` score matrix (temporary doc)."""
from __future__ import annotations

from ..runtime import RUNTIME, default_num_threads, get_num_threads, set_num_threads
from . import backend, backward_pass, forward_pass, plan, scoring, split, thresholds  # noqa: F401
from .backend import TILED, TiledBackend, backward, forward, tiled_attention
from .thresholds import (AUTO_MIN_KEYS, AUTO_TILED_MIN_HEAD_SCORES, AUTO_TILED_MIN_SCORES, BAND_GROUP_SCORES, BLOCK_K,
                     BLOCK_K_BACKWARD, BLOCK_K_PLAIN, BLOCK_Q, BLOCK_Q_BACKWARD, BLOCK_Q_PLAIN, DIAGONAL_MIN,
                     DIAGONAL_MIN_PLAIN, GRID_CALL_COST, GRID_CALL_COST_BACKWARD, GRID_CELL, GROUP_GQA, LAZY_BOUND,
                     PLAIN_LOOP, SERIAL_BELOW_FLOPS, SHIFT_FREE_BOUND, SPLIT_K_MIN_BLOCKS, SPLIT_K_MIN_PART_KEYS,
                     Limits, current_limits, limits)

__all__ = ["forward", "backward", "TiledBackend", "TILED", "tiled_attention", "Limits", "limits", "current_limits",
           "RUNTIME", "default_num_threads", "get_num_threads", "set_num_threads",
           "AUTO_MIN_KEYS", "AUTO_TILED_MIN_HEAD_SCORES", "AUTO_TILED_MIN_SCORES", "BAND_GROUP_SCORES", "BLOCK_K",
           "BLOCK_K_BACKWARD", "BLOCK_K_PLAIN", "BLOCK_Q", "BLOCK_Q_BACKWARD", "BLOCK_Q_PLAIN", "DIAGONAL_MIN",
           "DIAGONAL_MIN_PLAIN", "GRID_CALL_COST", "GRID_CALL_COST_BACKWARD", "GRID_CELL", "GROUP_GQA", "LAZY_BOUND",
           "PLAIN_LOOP", "SERIAL_BELOW_FLOPS", "SHIFT_FREE_BOUND", "SPLIT_K_MIN_BLOCKS", "SPLIT_K_MIN_PART_KEYS"]
