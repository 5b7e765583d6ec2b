"""The engine's limits — its block sizes and thresholds — as parameters of each call's plan.

Each module constant below is the default of the :class:`Limits` field of the same name (lower case). The
engine never reads the constants while it runs: a call takes the limits in force once, at its start
(:func:`current_limits`, into the problem: ``P.limits``), and everything it plans and runs reads them from
there — so its workers see the caller's limits, and calls from other threads (or other contexts) theirs.
:func:`limits` moves them for the calls inside a ``with`` block (the configuration's one context variable,
:func:`qkv.config`'s ``limits``: thread-safe, nothing global rewritten), e.g. so a test can put every threshold inside a small problem::

    with tiled.limits(block_q=64, kernel_min=0, split_k_min_part_keys=16):
        tiled.forward(q, k, v, scale=0.125)

``kernel_min`` is :data:`qkv.kernels.KERNEL_MIN` for the engine's calls (passed to
:meth:`qkv.kernels.Kernels.for_block`); the models' own kernel calls keep the module's.
"""
from __future__ import annotations

import contextlib
import dataclasses

from qkv import _checks, _settings
from qkv.compute.kernels import KERNEL_MIN as _KERNEL_MIN

#: Default query block of the forward (rows per task) and key block (columns per matmul): large query blocks
#: mean fewer Python steps holding the GIL, which two workers share; 1024 × 512 (2 MB of scores) was the fastest
#: of 128…1024 × 512…2048 (the figures behind this file's constants: benchmarks/RESULTS.md, "The engine's limits").
BLOCK_Q = 1024
BLOCK_K = 512
#: Tasks (one query block of one head) smaller than this many flops run on the calling thread alone: their
#: time is mostly Python steps holding the GIL, and two workers passing it back and forth lose (even at 8 Mflop).
SERIAL_BELOW_FLOPS = 1 << 23
#: Causal diagonal squares are split in quadrants down to this many rows (see _Problem.key_blocks): fewer,
#: larger blocks, fewer Python steps under the GIL; 256 was the fastest of 128 / 256 / 512.
DIAGONAL_MIN = 256
#: …and in the compiled loop of plain blocks (_plain_plan), where a block costs no Python: each halving down to
#: 32 was as fast or faster and halves the scores computed and thrown away; 16 was slower.
DIAGONAL_MIN_PLAIN = 32
#: …whose key blocks are BLOCK_K_PLAIN wide (where no block_k is given and S > BLOCK_K): 1024 × 256 scores
#: (1 MB, an L2's size) against BLOCK_K's 2 MB, which the GEMM writes, the exponential rewrites and the P·V
#: product packs from L3: 0.97–0.98× the time. The backward's blocks showed no such gain, and stay; where all
#: the keys fit one BLOCK_K block they stay one.
BLOCK_K_PLAIN = 256
#: The compiled loops' blocks are then cut into pieces of at most BAND_ROWS_PLAIN query positions (times the
#: grouped heads) by BAND_KEYS_PLAIN keys, taken row band by row band. OpenBLAS (SkylakeX kernels) multiplies
#: such small products without packing its operands, and the row band's Q, scores and acc stay in L1/L2 while
#: the keys stream by: the fastest pieces for the GEMMs (the causal forward at N = 8192 0.89× the time).
BAND_ROWS_PLAIN = 64
BAND_KEYS_PLAIN = 128
#: …and whose tasks take BLOCK_Q_PLAIN query rows (positions × grouped heads; where no block_q is given), each
#: a compiled loop over blocks of that many rows: a task's own costs (its Python, the query rows' norms and
#: scaling, the output's division) paid half as often, and each product's packed Kᵀ and V block used by twice
#: as many rows.
BLOCK_Q_PLAIN = 2048
#: Forward (and backward): plain blocks (no mod, no mask but the causal diagonal, nothing else reading the
#: scores) run as one compiled loop per task, its GEMMs by the provider's C sgemm (:func:`_plain_plan`),
#: where numba and that function are there. False: the Python loop always (tests compare the two).
PLAIN_LOOP = True
#: Forward: grouped-query heads (without masks, mods or sinks) run a group per task, rows interleaved.
GROUP_GQA = True
#: Backward: key block (rows of dK/dV per step) and query block.
BLOCK_K_BACKWARD = 512
BLOCK_Q_BACKWARD = 512
#: A query block whose scaled scores are all within ±SHIFT_FREE_BOUND runs without a running max:
#: exp(30) ≈ 1e13 and exp(−30) ≈ 1e−13 are far from float32's overflow (3e38) and underflow (1e−38).
SHIFT_FREE_BOUND = 30.0
#: Lazy rescaling keeps the running max m_i while a block's row sums Σ exp(s − m_i) stay below exp(this).
LAZY_BOUND = 40.0
#: Block masks: the per-call overhead of one rectangle of cells (a matmul, exp, matmul and their Python
#: steps), in BLOCK_SIZE² cells of work; the planner halves a row range while the halves cost less
#: (see _Problem.grid_blocks).
GRID_CALL_COST = 0.75
#: …and in the backward, whose blocks take five matmuls and more passes each.
GRID_CALL_COST_BACKWARD = 2.0
#: A run of bands is batched up to this many scores at a time: the GIL is handed over less often (a window
#: of 512 at N = 8192: 0.178× the causal forward's time, against 0.20× one band at a time).
BAND_GROUP_SCORES = 2 * BLOCK_Q * BLOCK_K
#: The engine's cells when a block mask's mod knows its block kinds (the built-ins): BLOCK_SIZE 128 is
#: refined to 32. A window's band has half-masked cells at both ends, half as wide with finer cells; 16 gained
#: nothing more for a 4× grid.
GRID_CELL = 32
#: …and the backward's (its blocks in the Python loop, where 32-cells were 2–12 % slower).
GRID_CELL_BACKWARD = 64


#: Split-K (flash-decoding): with fewer (head, query block) tasks than workers, the key range is split among
#: the workers, each part returning ``(out, lse)``, merged by :func:`qkv.merge.merge_partials`, when there
#: are at least this many key blocks to share…
SPLIT_K_MIN_BLOCKS = 2
#: …and each part gets at least this many keys. Few query rows make the work memory-bound, and a split's fixed
#: costs (the hand-off to the workers, the parts' buffers, the merge) must be paid back: parts of 32768 keys
#: were 1.3× slower than unsplit, parts of 131072 0.7×.
SPLIT_K_MIN_PART_KEYS = 1 << 16

#: ``backend="auto"`` runs the tiled engine when the scores (…, Hq, L, S) would hold at least
#: AUTO_TILED_MIN_SCORES numbers (2 MiB in float32) *and* each head's L·S at least AUTO_TILED_MIN_HEAD_SCORES
#: (≈ 362²): with large heads the two are even at about 2^18 scores, the tiled engine 1.4× faster at 2^19; with
#: many small heads its per-head work does not pay, so those, like everything small, take the reference, which
#: is also the observable path.
AUTO_TILED_MIN_SCORES = 1 << 19
AUTO_TILED_MIN_HEAD_SCORES = 1 << 17
#: …and at least this many keys (a key block narrower than this makes thin, inefficient matmuls).
AUTO_MIN_KEYS = 128
#: The backward of problems up to this many scores (batch × heads × L × S) runs on whole arrays (the
#: reference backend) under ``backend="auto"``, larger ones tiled: the tiled engine's per-block steps cost more
#: than they save below about 2^18 scores.
BACKWARD_WHOLE_SCORES = 1 << 18


#: A block-mask problem's tasks in the compiled loop, full cells plain and partial cells by their 0/1 tiles
#: (:mod:`qkv.backends.tiled.sparse`), where the loop runs, the scores are bounded and no score mod, float mask,
#: weights or dropout take part; False: the Python loop's strategies (bands, shift-free blocks).
TILE_LOOP = True
#: …whose tasks are this many query rows (a block mask's cells, where the tile loop will run): a task's Python
#: around its one compiled call (its rows scaled, the buffers, the output's division) hands the GIL to and
#: fro, and two workers waited on each other's: a window of 512 took 0.157× the causal forward's time in tasks
#: of 4096 rows, 0.20× in 1024.
BLOCK_Q_TILES = 4096
#: …and plan a block mask's cell rows in strips of this many query positions: a cell row's full cells and the
#: edge cells of a band in i − j (a sliding window's) one run of keys a strip, the edges masked in the loop
#: (:mod:`qkv.backends.tiled.sparse`). The strip's two edge triangles are what it computes for nothing
#: (1/16 of a window of 512's scores in 32-row strips, 1/32 in 16): 16-row strips were the fastest of 8, 16, 32.
STRIP_ROWS_TILES = 16


@dataclasses.dataclass(frozen=True)
class Limits:
    """The engine's thresholds and block sizes, each the module constant of the same name (upper case) by
    default; ``kernel_min`` is :data:`qkv.kernels.KERNEL_MIN`'s default. :func:`limits` moves them for the
    calls inside a block."""
    block_q: int = BLOCK_Q
    block_k: int = BLOCK_K
    block_q_plain: int = BLOCK_Q_PLAIN
    band_rows_plain: int = BAND_ROWS_PLAIN
    band_keys_plain: int = BAND_KEYS_PLAIN
    block_k_plain: int = BLOCK_K_PLAIN
    block_q_backward: int = BLOCK_Q_BACKWARD
    block_k_backward: int = BLOCK_K_BACKWARD
    serial_below_flops: int = SERIAL_BELOW_FLOPS
    diagonal_min: int = DIAGONAL_MIN
    diagonal_min_plain: int = DIAGONAL_MIN_PLAIN
    plain_loop: bool = PLAIN_LOOP
    tile_loop: bool = TILE_LOOP
    block_q_tiles: int = BLOCK_Q_TILES
    strip_rows_tiles: int = STRIP_ROWS_TILES
    group_gqa: bool = GROUP_GQA
    shift_free_bound: float = SHIFT_FREE_BOUND
    lazy_bound: float = LAZY_BOUND
    grid_call_cost: float = GRID_CALL_COST
    grid_call_cost_backward: float = GRID_CALL_COST_BACKWARD
    band_group_scores: int = BAND_GROUP_SCORES
    grid_cell: int = GRID_CELL
    grid_cell_backward: int = GRID_CELL_BACKWARD
    split_k_min_blocks: int = SPLIT_K_MIN_BLOCKS
    split_k_min_part_keys: int = SPLIT_K_MIN_PART_KEYS
    kernel_min: int = _KERNEL_MIN
    auto_tiled_min_scores: int = AUTO_TILED_MIN_SCORES
    auto_tiled_min_head_scores: int = AUTO_TILED_MIN_HEAD_SCORES
    auto_min_keys: int = AUTO_MIN_KEYS
    backward_whole_scores: int = BACKWARD_WHOLE_SCORES


#: The limits where the configuration sets none (a frozen dataclass: never written).
DEFAULT_LIMITS = Limits()
_NAMES = frozenset(f.name for f in dataclasses.fields(Limits))
#: The limits that are sizes (rows, keys, cells): a positive integer each — 0 would divide by zero or loop
#: for ever in the planner.
_SIZES = frozenset({"block_q", "block_k", "block_q_plain", "block_k_plain", "band_rows_plain", "band_keys_plain",
                    "block_q_backward", "block_k_backward", "diagonal_min", "diagonal_min_plain", "block_q_tiles",
                    "strip_rows_tiles", "grid_cell", "grid_cell_backward"})


def current_limits() -> Limits:
    """The limits in force now (in this thread and context: :func:`qkv.config`'s ``limits``): what an engine call
    started here plans with."""
    lim = _settings.current().limits
    return DEFAULT_LIMITS if lim is None else lim


def moved(base: Limits | None = None, /, **changes) -> Limits:
    """``base`` (None: the limits in force) with ``changes`` (names: :class:`Limits`' fields), each checked: a
    ValueError names an unknown one or a size that is not a positive integer."""
    bad = sorted(set(changes) - _NAMES)
    if bad:
        raise ValueError(f"limits: unknown {', '.join(bad)}; expected some of {', '.join(sorted(_NAMES))}")
    for name in sorted(_SIZES & set(changes)):
        changes[name] = _checks.positive_int(changes[name], name)
    return dataclasses.replace(current_limits() if base is None else base, **changes)


@contextlib.contextmanager
def limits(**changes):
    """Move the engine's thresholds for the calls inside the block (names: :class:`Limits`' fields), e.g.
    ``with limits(block_q=64, kernel_min=0, split_k_min_part_keys=16): ...``; restored on leaving. Yields the
    limits in force inside. Per thread and context (:func:`qkv.config`'s context variable, whose ``limits``
    this sets): calls made meanwhile from other threads keep theirs."""
    new = moved(**changes)
    with _settings.override(limits=new):
        yield new
