"""The engine's fused block kernels: the softmax's elementwise work on a block of scores in one pass.

After a block's ``Q·Kᵀ`` the tiled engine still has, per score, what NumPy does in separate passes over the
block: softcap's ``cap·tanh`` (or its fitted polynomial), the causal mask on a diagonal block, the running
max's shift, ``exp``, and the row sums. NumPy's float32 ``exp`` alone costs 1.4–2 ns a score on the AMD EPYC
test machine (no vectorized ``exp`` for AVX2 in its wheels), about a third of the block's two matmuls. With
the ``jit`` extra (``pip install 'qkv[jit]'``: numba) these run as one compiled, vectorized loop per block
(:mod:`qkv.compute._jit`): exp and row sums in half the time of NumPy's exp alone, softcap and exp in half of
NumPy's two passes; a shift-free block in base 2 (the engine folds log₂ e into the query rows, :func:`run` with
``base2``) faster still (the figures: benchmarks/RESULTS.md, "The block kernels").

Where a task's blocks are nothing else — unmodified, no mask but the causal one — the engine runs the whole
task as one compiled loop (:func:`run_plain` shift-free, :func:`run_plain_lazy`, :func:`run_plain_backward`),
the kernels called between the GEMM provider's own C ``sgemm`` calls with nothing of Python in between (see
:mod:`qkv.backends.tiled.forward_pass`).

Choice, as the GEMM's (:mod:`qkv.gemm`): ``set_kernels("auto" | "numpy" | "numba")`` / :func:`get_kernels`,
or ``QKV_KERNELS`` in the environment. ``auto`` (the default) takes numba where it is installed; ``numpy``
keeps the engine on NumPy alone; ``numba`` without the extra is a ValueError naming it. Only float32 blocks
of at least :data:`KERNEL_MIN` scores use a kernel (numba is imported, ~0.3 s, and its cached machine code
loaded, the first time one does), so small work — the explainer, a short sentence — never imports numba.
float64 stays on NumPy, whose ``exp`` is exact to the last bit the tests check. Results equal NumPy's to float32 rounding (the kernels' ``exp``
is within 2.1e-7 relative of the exact value, NumPy's float32 ``exp`` 1.2e-7).
"""
from __future__ import annotations

import functools
import sys
import threading
import time
import types

import numpy as np

from qkv import _checks, _settings
from qkv.compute import paths

__all__ = ["KERNEL_MIN", "PROVIDERS", "Kernels", "KERNELS", "get_kernels", "hold_one_thread", "set_kernels"]

#: The kernel providers.
PROVIDERS = ("numpy", "numba")
#: Blocks of fewer scores than this stay on NumPy's passes.
KERNEL_MIN = 1 << 14
_INSTALL = "pip install 'qkv[jit]'"
#: ``d`` (the causal diagonal's offset) that masks nothing.
NO_MASK = 1 << 62
#: ``lo`` (a band's lower edge, :func:`qkv.compute._jit.plain_rows`' eighth column) that masks nothing.
NO_LO = -NO_MASK
_KIND = types.MappingProxyType({"exp": 0, "poly": 1, "tanh": 2})   # the kernels' kinds of score function f
_NO_COEF = np.zeros(7, np.float32)


_held = threading.local()      # .pending: hold_one_thread() was called before numba was imported


class Kernels:
    """The process's block kernels (held by the engine's runtime as ``RUNTIME.kernels``): numba's compiled module
    once loaded — a resource; the *choice* is the configuration's (:func:`qkv.config`'s ``kernels``,
    :func:`set_kernels` its process default)."""

    def __init__(self):
        self._lock = threading.Lock()
        #: The first choice: "auto" unless QKV_KERNELS names another; in force while the configuration sets none.
        self.initial = _checks.env_choice("QKV_KERNELS", PROVIDERS)
        self._jit = None                                   # qkv.compute._jit once imported; False: numba missing
        #: Called once the kernels are loaded (the engine's runtime registers its BLAS rescan here).
        self.on_load: list = []
        self.error = None                                  # why numba could not be used, if it could not

    @property
    def choice(self) -> str:
        """The choice in force here: the configuration's ``kernels``, else :attr:`initial`. Assigning it sets
        the process default, unchecked (:meth:`set` checks)."""
        c = _settings.current().kernels
        return self.initial if c is None else c

    @choice.setter
    def choice(self, name: str) -> None:
        _settings.set_default(kernels=None if name == self.initial else name)     # unchecked, as QKV_KERNELS is

    def jit(self):
        """The compiled kernels (:mod:`qkv.compute._jit`), imported on first use; None without numba. In a
        thread :func:`hold_one_thread` marked before numba was imported, its thread count is set here, once."""
        if _held.__dict__.get("pending"):
            _held.pending = False
            hold_one_thread()
        if self._jit is None:
            with self._lock:
                if self._jit is None:
                    try:
                        from qkv.compute import _jit
                        _warm(_jit)
                        self._jit = _jit
                        for hook in self.on_load:         # the runtime rescans BLAS: numba imports SciPy,
                            hook()                        # which brings an OpenBLAS of its own
                    except ImportError as e:               # numba not installed (or its llvmlite)
                        self._jit, self.error = False, f"{type(e).__name__}: {e}"
        return self._jit or None

    def _importable(self) -> bool:
        if self._jit is not None:
            return bool(self._jit)
        from importlib.util import find_spec
        return find_spec("numba") is not None

    def check(self, name: str, what: str = "name") -> str:
        """``name`` if it is a choice that can run here (``"auto"``, ``"numpy"``, ``"numba"`` with its extra);
        a TypeError/ValueError naming ``what`` otherwise."""
        if not isinstance(name, str):
            raise TypeError(f"{what}: expected a str, one of {('auto',) + PROVIDERS}, got {type(name).__name__}")
        if name not in ("auto",) + PROVIDERS:
            raise ValueError(f"{what}: expected one of {('auto',) + PROVIDERS}, got {name!r}")
        if name == "numba" and self.jit() is None:
            raise ValueError(f"kernels: 'numba' needs numba, which is not installed ({self.error}): {_INSTALL}")
        return name

    def set(self, name: str = "auto") -> None:
        """The process default of the configuration's ``kernels`` (the environment's choice, :attr:`initial`, is
        its not-set state)."""
        self.check(name)
        _settings.set_default(kernels=None if name == self.initial else name)

    def get(self) -> str:
        """The provider in use: ``"numba"`` or ``"numpy"``."""
        choice = self.choice
        if choice == "numpy":
            return "numpy"
        if choice == "numba":
            self._required()
        return "numba" if self._importable() else "numpy"

    def _required(self):
        """The kernels, for the choice ``numba`` (from QKV_KERNELS): a ValueError naming the extra without it."""
        j = self.jit()
        if j is None:
            raise ValueError(f"QKV_KERNELS: 'numba' needs numba, which is not installed: {_INSTALL}")
        return j

    def _wanted(self, dtype, size: int, minimum: int | None) -> bool:
        """Whether a block of ``size`` scores of ``dtype`` should use the kernels (at least ``minimum`` scores;
        None: :data:`KERNEL_MIN`)."""
        return (self.choice != "numpy" and size >= (KERNEL_MIN if minimum is None else minimum)
                and dtype == np.float32)

    def describe(self) -> str:
        """``numba 0.68.1`` or ``numpy`` — for benchmark headers."""
        if self.get() == "numpy":
            return "numpy"
        import numba
        return f"numba {numba.__version__}"

    def for_call(self, dtype, size: int, minimum: int | None = None):
        """Called by the engine before it runs its tasks (outside its BLAS limit): loads the kernels when
        blocks of ``size`` scores of ``dtype`` will use them (see :func:`_warm`). Returns them or None.
        ``minimum``: the fewest scores a block takes them for (None: :data:`KERNEL_MIN`; the tiled engine passes
        its call's limit, :attr:`qkv.backends.tiled.Limits.kernel_min`)."""
        if not self._wanted(dtype, size, minimum):
            return None
        return self._required() if self.choice == "numba" else self.jit()

    def for_block(self, dtype, size: int, minimum: int | None = None):
        """The kernels for a block of ``size`` scores of ``dtype`` inside a task, else None (``minimum`` as
        :meth:`for_call`'s). Never loads them (:meth:`for_call` does, before the tasks)."""
        return (self._jit or None) if self._wanted(dtype, size, minimum) else None


def _warm(jit) -> None:
    """The process's first numba call, on a tiny block (the cheapest kernel): numba initializes its compiler
    then (≈ 1.5 s on an empty cache) and loads SciPy's OpenBLAS — before the engine's BLAS limit
    (:meth:`Kernels.for_call`; the runtime rescans BLAS after it): measured, a first call made while
    threadpoolctl held OpenBLAS at one thread left later limits from other Python threads without effect
    (BLAS stayed at 2 threads inside the next call). The other kernels, and the compiled loops, compile (or
    load from numba's cache) at their first call, wherever that is — the libraries threadpoolctl sees change
    at the first compile only (checked) — so that a first forward compiles what it runs, not every kernel
    (on an empty cache, a third of the time of warming them all first)."""
    s = np.zeros((2, 2), np.float32)
    jit.ds_rows(s, s.copy(), np.zeros(2, np.float32))


#: The process's block kernels (the choice is the configuration's).
KERNELS = Kernels()


def hold_one_thread() -> None:
    """Run the calling thread's parallel numba kernels on that thread alone from now on (numba's thread count
    is per thread): for the engine's workers, which are the parallelism. A worker that launched a kernel on two
    threads made libgomp a team of its own; with more of its threads than CPUs, libgomp stops spinning between
    parallel regions (1,000 spins, not 300,000), and the main thread's kernels then slept and woke at every
    region: a decoding step at 4,096 positions after a prompt took 26 ms in the attention instead of 7 ms
    (600 context switches a step). Without numba imported yet it is not imported here: the thread's first
    :meth:`Kernels.jit` sets it."""
    numba = sys.modules.get("numba")
    if numba is None:
        _held.pending = True
        return
    numba.set_num_threads(1)


def set_kernels(name: str = "auto") -> None:
    """Choose the engine's block kernels — the process default of :func:`qkv.config`'s ``kernels``: ``"auto"`` (numba where installed), ``"numpy"`` (NumPy's passes
    alone) or ``"numba"`` (needs ``pip install 'qkv[jit]'``)."""
    KERNELS.set(name)


def get_kernels() -> str:
    """The block kernels in use: ``"numba"`` or ``"numpy"``."""
    return KERNELS.get()


# The compiled kernels, counted where they run (qkv.paths): the matrix of tests proves it reaches each.
_P_EXP = types.MappingProxyType({k: paths.register(f"kernel.exp_rows.{k}", "fused block pass: f(s) + shift, exp, "
                                                   f"row sums (f: {k})") for k in ("exp", "poly", "tanh")})
_P_EXP2 = paths.register("kernel.exp_rows.base2", "fused block pass in base 2 (2^s, log2 e folded into the rows)")
_P_MAX = paths.register("kernel.max_exp_rows", "fused block pass with the running max's update (max, shift, exp)")
_P_BANDS = paths.register("kernel.pattern_exp_rows", "fused pass over a batch of bands sharing one mask pattern")
_P_DS = paths.register("kernel.ds_rows", "backward: dS' = P * (dP - D) in one pass")
_P_PLAIN = paths.register("kernel.plain_rows", "compiled forward loop of a task, shift-free, base 2")
_P_TILES = paths.register("kernel.plain_rows.tiles", "compiled forward loop of a task with a block mask's "
                                                     "partial cells as tiles")
_NO_TILES = np.zeros((1, 1, 1), np.float32)               # plain_rows' tiles where the blocks name none
_P_MODS = paths.register("kernel.mod_rows", "compiled forward loop of a task under ALiBi or a softcap, shift-free, "
                                            "base 2")
_P_PLAIN_LAZY = paths.register("kernel.plain_lazy_rows", "compiled forward loop of a task, lazy rescaling")
_P_PLAIN_BWD = paths.register("kernel.plain_backward_rows", "compiled backward loop of a head's key block")
_P_KT = paths.register("kernel.kt_prep", "a key head's [Kᵀ; 1] and its rows' largest norm in one compiled pass")
_P_Q = paths.register("kernel.q_prep", "a task's scaled query rows and their largest norm in one compiled pass")
_P_FINISH = paths.register("kernel.finish_rows", "a task's output division and lse, compiled")


def _args(kind: str, arg):
    """The kernels' ``(kind, coef, cap)`` for a plan's ``kind`` ("exp", "poly" with seven coefficients, "tanh"
    with the cap) and its argument."""
    return (_KIND[kind], arg if kind == "poly" else _NO_COEF,
            np.float32(arg) if kind == "tanh" else np.float32(1.0))


def run(jit, s: np.ndarray, sums: np.ndarray, plan, bounded: bool = False, base2: bool = False) -> None:
    """Finish a block the scorer left for a kernel (:meth:`qkv.backends.tiled.scoring._Scorer.__call__` with
    ``fuse=True``): ``s ← exp(f(s) + add)``, masked to the causal diagonal ``d``, ``sums`` its row sums.
    ``plan = (kind, arg, add, d, rep)``: kind ``"exp"`` (f = identity), ``"poly"`` (arg: seven coefficients,
    f(y) = y·Σ arg[k]·y^2k) or ``"tanh"`` (arg: cap, f = cap·tanh). ``bounded``: the caller knows every
    argument of the exponential lies in [−87, 88] (a shift-free block without a mask's −inf): the kernel's
    exp without its clamps. ``base2`` (kind ``"exp"``): the scores and ``add`` carry log₂ e (the engine folds
    it into the query rows of shift-free blocks), the exponential is 2^x — e^score with a third less work;
    no clamps (every argument in [−126, 127])."""
    kind, arg, add, d, rep = plan
    if base2 and kind != "exp":
        raise ValueError(f"plan: base2 needs kind 'exp' (scores that carry log₂ e), got {kind!r}")
    paths.hit(_P_EXP2 if base2 else _P_EXP[kind])
    jit.exp_rows(s.reshape(-1, s.shape[-1]), *_args(kind, arg), add, sums, d, rep, bool(bounded), bool(base2))


@functools.cache
def _clock():
    """libc's clock_gettime as a ctypes function (found once; functools.cache is thread-safe)."""
    import ctypes
    fn = ctypes.CDLL(None).clock_gettime
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_int
    return fn


#: The clock the compiled loops time their GEMM calls on (when :func:`qkv.bench.gemm_share` asks): the monotonic
#: one, which libc reads in user space (vDSO, ~20 ns). The thread's CPU clock is a system call (~0.6 µs here),
#: and its ~1,200 reads made a causal forward 2–3 % slower than untimed — the share then measured its own
#: timer. Timed on this clock, the forward takes its untimed time.
GEMM_CLOCK = getattr(time, "CLOCK_MONOTONIC", None)                # (None where the platform has no such clock)


def _run_loop(loop, gemm, *args) -> None:
    """A compiled loop of :mod:`qkv.compute._jit` on ``gemm``'s C sgemm, its GEMMs' time (on :data:`GEMM_CLOCK`) and
    flops added to ``gemm.clock`` when that is set (:func:`qkv.bench.gemm_share`)."""
    timer = gemm.clock
    gemm.before_c_calls()                                # MKL: this thread's count, as its matmul sets it
    spent, flops = loop(gemm.c_sgemm, _clock(), GEMM_CLOCK, timer is not None, *args)
    if timer is not None:
        timer[0] += spent
        timer[1] += flops


def run_plain(jit, gemm, qs, k_t, v, blocks, s_flat, acc, l_i, sums, zeros, rep: int) -> None:
    """A task's shift-free blocks of plain scores in one compiled loop (:func:`qkv.compute._jit.plain_rows`), the
    GEMMs by ``gemm``'s C function (:attr:`qkv.gemm.NumpyGemm.c_sgemm`), timed into its ``clock`` when set."""
    paths.hit(_P_PLAIN)
    _run_loop(jit.plain_rows, gemm, qs, k_t, v, blocks, _NO_TILES, s_flat, acc, l_i, sums, zeros, rep)


def run_tiles(jit, gemm, qs, k_t, v, blocks, tiles, s_flat, acc, l_i, sums, zeros, rep: int) -> None:
    """:func:`run_plain` for a block mask's task: ``blocks`` with a seventh column naming the 0/1 tile of
    ``tiles`` (T, positions, keys) float32 that masks a partial cell (−1: a full one)."""
    paths.hit(_P_TILES)
    _run_loop(jit.plain_rows, gemm, qs, k_t, v, blocks, tiles, s_flat, acc, l_i, sums, zeros, rep)


def run_mods(jit, gemm, qs, k_t, v, blocks, s_flat, acc, l_i, sums, rep: int, a0: int, kind: int, coef, cap: float,
             slope: float) -> None:
    """A task's shift-free blocks under ALiBi (``slope``, NaN: none) and/or a softcap (``kind``, ``coef``,
    ``cap`` as :func:`qkv.compute._jit._f_row`'s, log₂ e in them) in one compiled loop (:func:`qkv.compute._jit_mods.mod_rows`),
    as :func:`run_plain`; ``a0`` the task's first query position. (``jit``, :mod:`qkv.compute._jit`, is loaded: so is
    numba for its companion module.)"""
    from qkv.compute._jit_mods import mod_rows
    paths.hit(_P_MODS)
    _run_loop(mod_rows, gemm, qs, k_t, v, blocks, s_flat, acc, l_i, sums, np.empty(k_t.shape[1], np.float32), rep,
              a0, kind, coef, np.float32(cap), float(slope))


def run_plain_lazy(jit, gemm, qs, k_t, v, blocks, s_flat, acc, l_i, m_i, seen, sums, zeros, rep: int, lazy: bool,
                   row_limit: float) -> None:
    """A task's blocks of unbounded plain scores (lazy rescaling) in one compiled loop
    (:func:`qkv.compute._jit.plain_lazy_rows`), as :func:`run_plain`."""
    paths.hit(_P_PLAIN_LAZY)
    _run_loop(jit.plain_lazy_rows, gemm, qs, k_t, v, blocks, s_flat, acc, l_i, m_i, seen, sums, zeros, rep,
              bool(lazy), np.float32(row_limit))


def run_plain_backward(jit, gemm, qs, do, lse_neg, dd, k, k_t, v, blocks, j0, j1, s_buf, dp_buf, sums, dk, dv,
                       dq) -> None:
    """One query head's backward blocks against keys j0 … j1 in one compiled loop
    (:func:`qkv.compute._jit.plain_backward_rows`), as :func:`run_plain`."""
    paths.hit(_P_PLAIN_BWD)
    _run_loop(jit.plain_backward_rows, gemm, qs, do, lse_neg, dd, k, k_t, v, blocks, j0, j1, s_buf, dp_buf, sums,
              dk, dv, dq)


def run_ds(jit, dp: np.ndarray, p: np.ndarray, dd: np.ndarray) -> None:
    """The backward's ``dP ← P ∘ (dP − D)`` in one pass (:func:`qkv.compute._jit.ds_rows`)."""
    paths.hit(_P_DS)
    jit.ds_rows(dp, p, dd)


def plain_available(gemm) -> bool:
    """Whether :func:`run_plain` can run on ``gemm`` (a provider with a C sgemm, libc's clock)."""
    if getattr(gemm, "c_sgemm", None) is None or GEMM_CLOCK is None:
        return False
    try:
        _clock()
    except Exception:                                    # no libc clock_gettime (or no CDLL(None) to find it in)
        return False
    return True


def run_max(jit, s: np.ndarray, sums: np.ndarray, plan, seen: np.ndarray, shift: np.ndarray, hit: np.ndarray) -> None:
    """As :func:`run`, with the running max's pass fused in: per row the block's max of ``f(s) + add`` (allowed
    columns), ``shift`` = ``max(that, 0)`` where ``seen`` (else that max, or 0 for a row with nothing finite:
    ``hit`` False), and ``s ← exp(f(s) + add − shift)``."""
    kind, arg, add, d, rep = plan
    paths.hit(_P_MAX)
    jit.max_exp_rows(s.reshape(-1, s.shape[-1]), *_args(kind, arg), add, sums, d, rep, seen, shift, hit)


def run_bands(jit, s: np.ndarray, sums: np.ndarray, kind: str, arg, pattern: np.ndarray) -> None:
    """Bands ``s`` (nb, h, w) sharing the additive mask ``pattern`` (h, w): ``s ← exp(f(s) + pattern)`` with
    ``f`` the identity (``kind`` "exp"), the polynomial or ``cap·tanh`` (as :func:`run`), ``sums`` (nb·h,)."""
    paths.hit(_P_BANDS)
    jit.pattern_exp_rows(s, *_args(kind, arg), pattern, sums)


def q_prep(jit, q: np.ndarray, out: np.ndarray, scale):
    """``out[r·g + h, :E] = q[h, r]·scale``, ``out[:, E] = 0`` (q (g, n, E)); returns the largest ``|q[h, r]|²``
    (:func:`qkv.compute._jit.q_prep`), or None where q's rows are not contiguous rows at non-negative strides (the
    caller's NumPy pass then)."""
    flat = _flat(q)
    if flat is None:
        return None
    paths.hit(_P_Q)
    size = q.itemsize
    return jit.q_prep(flat, q.shape[0], q.shape[1], q.shape[2], q.strides[0] // size, q.strides[1] // size, out,
                      np.float32(scale))


def _flat(a: np.ndarray):
    """A C-contiguous 1-D view of the memory a 3-D ``a`` spans (from its first element), where its last axis is
    contiguous and its other strides are non-negative multiples of its item size; else None."""
    size = a.itemsize
    if a.size == 0 or a.strides[2] != size or any(s < 0 or s % size for s in a.strides[:2]):
        return None
    span = sum((n - 1) * s for n, s in zip(a.shape, a.strides)) // size + 1
    return np.lib.stride_tricks.as_strided(a, shape=(span,), strides=(size,))


def kt_prep(jit, k: np.ndarray, k_t: np.ndarray) -> float:
    """``k_t = [kᵀ; 1]`` (k (S, E) contiguous) and the largest ``|k[j]|²`` in one compiled pass
    (:func:`qkv.compute._jit.kt_prep`)."""
    paths.hit(_P_KT)
    return jit.kt_prep(k, k_t)


def finish_rows(jit, acc: np.ndarray, l_i: np.ndarray, m_i: np.ndarray, out: np.ndarray, lse) -> None:
    """``out[h, r] = acc[r·g + h] / l_i[r·g + h]`` and ``lse[h, r] = m_i[r·g + h] + log l_i[r·g + h]`` (when
    not None) of a task's rows (out (g, n, Ev), lse (g, n); :func:`qkv.compute._jit.finish_rows`): zeros and −inf
    where ``l_i = 0``."""
    paths.hit(_P_FINISH)
    jit.finish_rows(acc, l_i, m_i, out, out[:, :, 0] if lse is None else lse, lse is not None)
