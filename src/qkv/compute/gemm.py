"""The engine's matrix multiply (GEMM), from one of several providers: NumPy's BLAS, or Intel MKL.

Every matmul of the tiled engine (forward, backward, :func:`qkv.attention_weights`) and of the models'
projections goes through :func:`matmul`, which asks the provider chosen with :func:`set_gemm`:

* ``"numpy"`` — ``np.matmul``, i.e. whatever BLAS NumPy was built with (OpenBLAS in the wheels). Always there.
* ``"mkl"`` — Intel MKL's ``cblas_sgemm`` / ``cblas_dgemm`` (and ``…gemv``, ``…gemm_batch_strided``) from
  ``libmkl_rt`` of the ``mkl`` wheel on PyPI (the extra: ``pip install 'qkv[mkl]'``), loaded with ctypes and
  called on the NumPy buffers themselves: a transposed or sliced view is passed as a transpose flag and a
  leading dimension, and only a view BLAS cannot describe (no unit stride, negative strides) is copied;
  ``out=`` is written in place. ctypes releases the GIL during the call, as ``np.matmul`` does.
* ``"auto"`` (the default) — ``"numpy"`` when MKL is not installed; otherwise a one-time calibration (the
  first time a sizeable matmul is asked for; 150–250 ms of wall time on the loaded 2-core test machine, about
  80 ms of it MKL's first call) times both on the engine's own block shapes on one thread, in CPU time, and
  takes MKL only when it is faster by more than :data:`AUTO_MARGIN`, so NumPy stays wherever it is as fast (on
  the AMD EPYC test machine, OpenBLAS's Haswell kernels beat MKL by 5–70 % on these shapes; on an Intel Xeon
  with AVX-512 the issue measured MKL 114–125 GFLOP/s against OpenBLAS's 85–92). Products under :data:`AUTO_RESOLVE_FLOPS`
  stay on NumPy under ``auto`` even where it took MKL (MKL's call costs more than they do). The blocks' ``exp``
  (:func:`exp`) is calibrated apart: MKL's vector math where it is faster (on the EPYC it is, 0.65–0.9 ms
  against 0.75–1.3 per 1024 × 512 block).

The first choice may come from the environment, ``QKV_GEMM=numpy|mkl|auto``, for scripts without an option
for it (``QKV_GEMM=mkl python benchmarks/bench_model.py``).

Threads: the engine's workers each run one single-threaded matmul at a time. NumPy's BLAS is held to one
thread process-wide by :class:`qkv.backends.runtime.Runtime`; MKL is held to one thread *per calling
thread* with ``mkl_set_num_threads_local(1)`` in the engine's workers and in a caller running tasks inline
(:func:`single_threaded`), so nothing oversubscribes and callers outside the engine keep MKL's own
setting. Results of the providers differ by float32 (float64) rounding only: the summation order inside a
GEMM is the library's.

Only float32 and float64 operands of one dtype go to MKL: matrices, a matrix times a vector, stacks of
matrices (broadcast leading dimensions; equal-sized 3-D batches in one ``gemm_batch_strided`` call); anything
else (other dtypes, mixed dtypes, a vector on the left) is ``np.matmul``'s.
"""
from __future__ import annotations

import types

import contextlib
import ctypes
import os
import threading
import time

import numpy as np

from qkv import _checks, _settings
from qkv.compute._cblas import NO_TRANS as _NO_TRANS, ROW_MAJOR as _ROW_MAJOR, TRANS as _TRANS   # CBLAS enums

__all__ = ["PROVIDERS", "Gemm", "GEMM", "exp", "get_gemm", "matmul", "set_gemm", "single_threaded"]

#: The providers, in the order ``auto`` prefers them when equally fast.
PROVIDERS = ("numpy", "mkl")
#: ``auto`` takes MKL only when its time on the engine's block shapes is below (1 − AUTO_MARGIN) × NumPy's.
AUTO_MARGIN = 0.05
#: The calibration's shapes ``(m, k, n)``: the forward's Q·Kᵀ and P·V blocks (1024 × 512 scores, E = 64) and
#: a causal diagonal's quadrant.
CALIBRATION_SHAPES = ((1024, 64, 512), (1024, 512, 64), (256, 64, 512))
_CALIBRATION_REPEATS = 5
#: Under ``auto``, products of fewer multiply-adds than this run on NumPy: before ``auto`` is resolved
#: (without resolving it) and after it took MKL, whose call costs 12–20 µs more than ``np.matmul``'s (a
#: 3 × 4 · 4 × 3 product 19 µs against 2.4). So the explainer's small products are NumPy's to
#: the bit wherever ``auto`` takes MKL; ``set_gemm("mkl")`` sends every product to MKL.
AUTO_RESOLVE_FLOPS = 1 << 20
_MKL_INSTALL = "pip install 'qkv[mkl]'"

# VML: high accuracy (VML_HA), errors ignored (VML_ERRMODE_IGNORE): inf on overflow, 0 on underflow, no callback
_VML_MODE = 0x2 | 0x100
#: VML's exp runs at full speed where every result is a normal float: x ≥ ln(smallest normal) (float32 −87.3,
#: float64 −708.4), with a margin.
_VML_FAST_MIN = types.MappingProxyType({"f": -87.0, "d": -708.0})

# threads of this process that must run MKL on one thread (the engine's workers, inline callers)
_tl = threading.local()


class single_threaded:
    """Within the block, matmuls on the calling thread run BLAS on one thread (MKL's thread-local setting;
    NumPy's BLAS is limited process-wide by the runtime). Nests; the engine's workers are inside for good."""

    __slots__ = ()

    def __enter__(self):
        _tl.single = getattr(_tl, "single", 0) + 1
        return self

    def __exit__(self, *exc):
        _tl.single -= 1
        return False


def hold_single_threaded_for_good() -> None:
    """Mark the calling thread (an engine worker) as running matmuls on one thread from now on."""
    _tl.single = getattr(_tl, "single", 0) + 1


# ---------------------------------------------------------------------------------------------- numpy
class NumpyGemm:
    """``np.matmul``: NumPy's own BLAS."""

    name = "numpy"
    #: Set by :func:`qkv.bench.gemm_share` (a float64 array ``[seconds, flops]``): the compiled block loop
    #: then times its GEMM calls into it, as the share's wrapper times :meth:`matmul`. None: not timed.
    clock = None

    @property
    def c_sgemm(self):
        """NumPy's own ``cblas_sgemm`` as a ctypes function, for compiled code that calls the GEMM itself (the
        engine's plain block loop, :func:`qkv.compute._jit.plain_rows`): the OpenBLAS NumPy's wheels bundle
        (``numpy.libs/libscipy_openblas64_*``: ``scipy_cblas_sgemm64_``, 64-bit ints; or the 32-bit-int
        build's ``scipy_cblas_sgemm``), checked once against ``np.matmul`` on a small product. None where
        NumPy was built against another BLAS (the engine then keeps its Python loop)."""
        return _numpy_cblas_sgemm()

    @staticmethod
    def before_c_calls() -> None:
        """What compiled code calling :attr:`c_sgemm` itself does first on its thread: nothing for NumPy's BLAS,
        whose thread count the runtime limits process-wide (:meth:`MklGemm.before_c_calls`: MKL's per thread)."""

    @staticmethod
    def matmul(a, b, out=None):
        return np.matmul(a, b, out=out)

    @staticmethod
    def exp(x, out=None):
        return np.exp(x, out=out)

    @staticmethod
    def kernel() -> str:
        """NumPy's BLAS and its kernel as threadpoolctl reports them (e.g. ``openblas 0.3.31 (Haswell)``)."""
        try:
            import threadpoolctl
        except ImportError:
            return "numpy's BLAS (threadpoolctl not installed: kernel unknown)"
        for i in threadpoolctl.threadpool_info():
            if i.get("user_api") == "blas" and "numpy" in str(i.get("filepath", "")).lower():
                return f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture')})"
        info = [i for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas"]
        if info:
            return f"{info[0].get('internal_api')} {info[0].get('version')} ({info[0].get('architecture')})"
        return "numpy's BLAS (unknown)"


_NUMPY_SGEMM: list = []                                   # [the ctypes function or None], once found


def _numpy_cblas_sgemm():
    """See :attr:`NumpyGemm.c_sgemm`."""
    if _NUMPY_SGEMM:
        return _NUMPY_SGEMM[0]
    fn = None
    libs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(np.__file__))), "numpy.libs")
    try:
        paths = sorted(os.path.join(libs, f) for f in os.listdir(libs) if "openblas" in f)
    except OSError:                                      # no bundled libraries (a system or conda NumPy)
        paths = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)                      # already loaded by NumPy: the same handle
        except OSError:
            continue
        for name, int_t in (("scipy_cblas_sgemm64_", ctypes.c_int64), ("scipy_cblas_sgemm", ctypes.c_int32)):
            got = getattr(lib, name, None)
            if got is None:
                continue
            E, P, F = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
            got.argtypes = [E, E, E, int_t, int_t, int_t, F, P, int_t, P, int_t, F, P, int_t]
            got.restype = None
            if _sgemm_agrees(got):
                fn = got
                break
        if fn is not None:
            break
    _NUMPY_SGEMM.append(fn)
    return fn


def _sgemm_agrees(fn) -> bool:
    """Whether ``fn`` (a CBLAS sgemm) computes ``np.matmul``'s product on a small case (a wrong guess of the
    library or its int width would not)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 3), dtype=np.float32)
    b = rng.standard_normal((3, 4), dtype=np.float32)
    c = np.full((5, 4), np.nan, np.float32)
    fn(_ROW_MAJOR, _NO_TRANS, _NO_TRANS, 5, 4, 3, 1.0, a.ctypes.data, 3, b.ctypes.data, 4, 0.0, c.ctypes.data, 4)
    return bool(np.allclose(c, a @ b, rtol=1e-5, atol=1e-6))


# ---------------------------------------------------------------------------------------------- mkl
def _mkl_library_path() -> str | None:
    """``libmkl_rt.so.*`` of the installed ``mkl`` wheel (its files as pip recorded them), or None."""
    try:
        from importlib import metadata
        dist = metadata.distribution("mkl")
    except Exception:                                    # not installed (PackageNotFoundError), broken metadata
        return None
    names = ("libmkl_rt.so", "libmkl_rt.", "mkl_rt.")    # Linux, macOS (.dylib), Windows (mkl_rt.2.dll)
    found = [f for f in (dist.files or ()) if os.path.basename(str(f)).startswith(names)]
    found.sort(key=lambda f: len(str(f)))                # libmkl_rt.so.3 before anything longer
    for f in found:
        path = os.path.realpath(str(dist.locate_file(f)))
        if os.path.exists(path):
            return path
    return None


class _MklVersion(ctypes.Structure):
    """MKL's ``MKLVersion``: the version, and the processor family whose code path it runs."""
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("update", ctypes.c_int),
                ("status", ctypes.c_char_p), ("build", ctypes.c_char_p), ("processor", ctypes.c_char_p),
                ("platform", ctypes.c_char_p)]


def _layout(r: int, c: int, s0: int, s1: int, it: int):
    """``(trans, ld)`` describing an (r, c) matrix of strides (s0, s1) bytes in row-major CBLAS terms, or
    None when no transpose flag and leading dimension do (no unit stride, negative or odd strides)."""
    if (s1 == it or c == 1) and (r == 1 or (s0 > 0 and s0 % it == 0 and s0 // it >= max(1, c))):
        return _NO_TRANS, max(1, c) if r == 1 else s0 // it    # rows of unit stride: as it is
    if (s0 == it or r == 1) and (c == 1 or (s1 > 0 and s1 % it == 0 and s1 // it >= max(1, r))):
        return _TRANS, max(1, r) if c == 1 else s1 // it       # a transposed view: columns of unit stride
    return None


def _describe(x: np.ndarray, it: int):
    """``(array, trans, ld)`` of a 2-D operand, a C-contiguous copy only when :func:`_layout` finds none."""
    got = _layout(*x.shape, *x.strides, it)
    if got is None:
        x = np.ascontiguousarray(x)
        got = (_NO_TRANS, max(1, x.shape[1]))
    return x, got[0], got[1]


def _describe_batch(x: np.ndarray, it: int):
    """``(array, trans, ld, batch stride)`` of a 3-D operand, a C-contiguous copy only when not describable."""
    nb, r, c = x.shape
    got = _layout(r, c, *x.strides[1:], it)
    s = x.strides[0]
    if got is None or s < 0 or s % it:
        x = np.ascontiguousarray(x)
        return x, _NO_TRANS, max(1, c), r * c
    return x, got[0], got[1], s // it


class MklGemm:
    """Intel MKL through its CBLAS interface (``libmkl_rt`` from the ``mkl`` wheel), on NumPy buffers."""

    name = "mkl"

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        I, P = ctypes.c_int, ctypes.c_void_p
        with _suppress():
            lib.MKL_Set_Interface_Layer.argtypes = [I]
            lib.MKL_Set_Interface_Layer(0)                   # LP64: 32-bit ints, as the argtypes below
        self._set_local = lib.MKL_Set_Num_Threads_Local
        self._set_local.argtypes, self._set_local.restype = [I], I
        self._fns = {}
        for char, dt, real in (("s", np.float32, ctypes.c_float), ("d", np.float64, ctypes.c_double)):
            gemm = getattr(lib, f"cblas_{char}gemm")
            gemm.argtypes = [I, I, I, I, I, I, real, P, I, P, I, real, P, I]
            gemm.restype = None
            gemv = getattr(lib, f"cblas_{char}gemv")
            gemv.argtypes = [I, I, I, I, real, P, I, P, I, real, P, I]
            gemv.restype = None
            batch = getattr(lib, f"cblas_{char}gemm_batch_strided", None)
            if batch is not None:
                batch.argtypes = [I, I, I, I, I, I, real, P, I, I, P, I, I, real, P, I, I, I]
                batch.restype = None
            self._fns[np.dtype(dt)] = (gemm, gemv, batch)
        self._vexp = {}
        for dt, name in ((np.float32, "vmsExp"), (np.float64, "vmdExp")):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = [I, P, P, ctypes.c_int64], None
                self._vexp[np.dtype(dt)] = fn
        self._lib = lib
        self.path = path
        #: MKL's ``cblas_sgemm`` (32-bit ints), for compiled code (as :attr:`NumpyGemm.c_sgemm`).
        self.c_sgemm = self._fns[np.dtype(np.float32)][0]
        #: As :attr:`NumpyGemm.clock`.
        self.clock = None

    def kernel(self) -> str:
        """MKL's version and the processor family of the code path it runs here, e.g. ``mkl 2026.0.2 (Intel(R)
        AVX-512 ... enabled processors)``; on the AMD EPYC test machine its generic ``Intel(R) Architecture
        processors`` path."""
        v = _MklVersion()
        try:
            self._lib.MKL_Get_Version(ctypes.byref(v))
        except AttributeError:
            return "mkl (version unknown)"
        proc = (v.processor or b"?").decode(errors="replace")
        return f"mkl {v.major}.{v.minor}.{v.update} ({proc})"

    def exp(self, x, out=None):
        """``np.exp(x, out=out)`` by MKL's vector math (VML ``vsExp``/``vdExp``, high-accuracy mode, errors
        ignored: overflow gives inf as NumPy's) for contiguous float32/float64 arrays; else ``np.exp``."""
        fn = self._vexp.get(x.dtype) if type(x) is np.ndarray else None
        if (fn is None or not x.flags.c_contiguous or x.size >= 1 << 31
                or (out is not None and (type(out) is not np.ndarray or out.dtype != x.dtype
                                         or out.shape != x.shape or not out.flags.c_contiguous))):
            return np.exp(x, out=out)
        if x.size and not x.min() >= _VML_FAST_MIN[x.dtype.char]:
            # VML is slow where results underflow (−inf, or below float's smallest normal: measured on the AMD
            # EPYC here, a 1024 × 512 block of −100…−88: 10.8 ms against NumPy's 1.9; of −inf: 0.67 against
            # 0.70), as ALiBi's far keys and masked cells do; one read-only pass (≈ 0.05 ms) picks NumPy there
            # (silent on overflow, as VML is).
            with np.errstate(over="ignore"):
                return np.exp(x, out=out)
        if out is None:
            out = np.empty_like(x)
        elif out is not x and np.may_share_memory(out, x):
            return np.exp(x, out=out)
        if x.size:
            self._threads()
            fn(x.size, x.ctypes.data, out.ctypes.data, _VML_MODE)
        return out

    def threads(self, n: int):
        """A context in which this thread's MKL calls use ``n`` threads (``mkl_set_num_threads_local``), for
        measuring its rate outside the engine (``qkv bench``)."""
        provider = self

        class _Local:
            def __enter__(self):
                self.saved = getattr(_tl, "single", 0)
                _tl.single = 0                             # _threads() must not reset it to 1
                provider._set_local(int(n))
                _tl.pinned = True
                return provider

            def __exit__(self, *exc):
                _tl.single, _tl.pinned = self.saved, False
                provider._set_local(0)
                return False
        return _Local()

    def before_c_calls(self) -> None:
        """Before compiled code calls :attr:`c_sgemm` itself (the engine's compiled loops): this thread's MKL thread
        count set as :meth:`matmul` sets it before each call — one inside the engine's workers and inline callers.
        Without it MKL ran a loop's GEMMs on its own count, two threads in each of two workers (found: the
        loops call MKL's C function directly, and a plain task makes no other MKL call that would set it)."""
        self._threads()

    def _threads(self) -> None:
        if getattr(_tl, "pinned", False):
            return
        # set every time, not remembered: threadpoolctl (qkv's runtime uses it) sets this same thread-local
        # count and restores it to MKL's max, which a remembered value would not see (the compiled loops then
        # ran MKL on two threads with threads=1, after a qkv bench in the process)
        self._set_local(1 if getattr(_tl, "single", 0) else 0)   # 0: MKL's own (process-wide) setting

    def matmul(self, a, b, out=None):
        """``a @ b`` into ``out`` (made when None), as ``np.matmul``; MKL for float32/float64 matrices."""
        if type(a) is not np.ndarray or type(b) is not np.ndarray:
            a, b = np.asarray(a), np.asarray(b)
        dt = a.dtype
        fns = self._fns.get(dt)
        if (fns is None or b.dtype != dt or (out is not None and (type(out) is not np.ndarray or out.dtype != dt))
                or a.ndim < 2 or b.ndim < 1):
            return np.matmul(a, b, out=out)
        if a.ndim == 2 and b.ndim == 2:
            return self._gemm(fns[0], a, b, out, dt)
        if a.ndim == 2 and b.ndim == 1:
            return self._gemv(fns[1], a, b, out, dt)
        if a.ndim == 3 and b.ndim == 3 and a.shape[0] == b.shape[0] and fns[2] is not None:
            return self._batch(fns[2], a, b, out, dt)
        if a.ndim == 3 and b.ndim == 1 and a.flags.c_contiguous and (out is None or out.flags.c_contiguous):
            o = self._gemv(fns[1], a.reshape(-1, a.shape[2]), b, None if out is None else out.reshape(-1), dt)
            return o.reshape(a.shape[:2]) if out is None else out
        if b.ndim >= 2:
            return self._stack(fns[0], a, b, out, dt)
        return np.matmul(a, b, out=out)

    def _stack(self, fn, a, b, out, dt):
        """Stacks of matrices with broadcast leading dimensions (``attention_weights``' heads): one GEMM per
        matrix of the result, each on views of the operands."""
        try:
            lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except ValueError:
            return np.matmul(a, b, out=out)                  # NumPy's own error message
        m, k = a.shape[-2:]
        k2, n = b.shape[-2:]
        if k != k2:
            return np.matmul(a, b, out=out)
        shape = lead + (m, n)
        if out is None:
            out = np.empty(shape, dt)
        elif out.shape != shape:
            raise ValueError(f"out: expected shape {shape} for a {a.shape} x {b.shape} matmul, got {out.shape}")
        a = np.broadcast_to(a, lead + (m, k))
        b = np.broadcast_to(b, lead + (k, n))
        for idx in np.ndindex(*lead):
            self._gemm(fn, a[idx], b[idx], out[idx], dt)
        return out

    def _out(self, out, shape, dt, a, b):
        """``out`` when BLAS can write it in place (rows of unit stride, not overlapping an operand), else a
        fresh C-contiguous array and the ``out`` to copy it into afterwards."""
        if out is None:
            return np.empty(shape, dt), None
        if out.shape != shape:
            raise ValueError(f"out: expected shape {shape} for a {a.shape} x {b.shape} matmul, got {out.shape}")
        st = out.strides
        it = dt.itemsize
        ok = (st[-1] == it or shape[-1] == 1) and all(s > 0 and s % it == 0 for s in st[:-1])
        if ok and len(shape) >= 2:
            ok = st[-2] // it >= max(1, shape[-1]) or shape[-2] == 1
        if ok and (np.may_share_memory(out, a) or np.may_share_memory(out, b)):
            ok = False
        return (out, None) if ok else (np.empty(shape, dt), out)

    def _gemm(self, fn, a, b, out, dt):
        m, k = a.shape
        k2, n = b.shape
        if k != k2:
            return np.matmul(a, b, out=out)                  # NumPy's own error message
        c, dest = self._out(out, (m, n), dt, a, b)
        if m == 0 or n == 0:
            return c if dest is None else dest
        if k == 0:
            c.fill(0)
        else:
            it = dt.itemsize
            a, ta, lda = _describe(a, it)
            b, tb, ldb = _describe(b, it)
            ldc = c.strides[0] // it if m > 1 else max(1, n)
            self._threads()
            fn(_ROW_MAJOR, ta, tb, m, n, k, 1.0, a.ctypes.data, lda, b.ctypes.data, ldb, 0.0, c.ctypes.data, ldc)
        if dest is not None:
            dest[...] = c
            return dest
        return c

    def _gemv(self, fn, a, x, out, dt):
        m, n = a.shape
        if x.shape[0] != n:
            return np.matmul(a, x, out=out)
        y, dest = self._out(out, (m,), dt, a, x)
        if m == 0:
            return y if dest is None else dest
        it = dt.itemsize
        if n == 0:
            y.fill(0)
        else:
            if x.strides[0] <= 0 or x.strides[0] % it:
                x = np.ascontiguousarray(x)
            a, ta, lda = _describe(a, it)
            self._threads()
            # row-major (m, n): NoTrans gives A·x; a transposed view is the (n, m) row-major matrix transposed
            rows, cols = (m, n) if ta == _NO_TRANS else (n, m)
            fn(_ROW_MAJOR, ta, rows, cols, 1.0, a.ctypes.data, lda, x.ctypes.data, x.strides[0] // it, 0.0,
               y.ctypes.data, y.strides[0] // it)
        if dest is not None:
            dest[...] = y
            return dest
        return y

    def _batch(self, fn, a, b, out, dt):
        nb, m, k = a.shape
        _, k2, n = b.shape
        if k != k2:
            return np.matmul(a, b, out=out)
        c, dest = self._out(out, (nb, m, n), dt, a, b)
        if nb == 0 or m == 0 or n == 0:
            return c if dest is None else dest
        it = dt.itemsize
        if k == 0:
            c.fill(0)
        else:
            a, ta, lda, sa = _describe_batch(a, it)
            b, tb, ldb, sb = _describe_batch(b, it)
            ldc = c.strides[1] // it if m > 1 else max(1, n)
            self._threads()
            fn(_ROW_MAJOR, ta, tb, m, n, k, 1.0, a.ctypes.data, lda, sa, b.ctypes.data, ldb, sb, 0.0,
               c.ctypes.data, ldc, c.strides[0] // it, nb)
        if dest is not None:
            dest[...] = c
            return dest
        return c


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, typ, *_):
        return typ is not None and issubclass(typ, AttributeError)


# ---------------------------------------------------------------------------------------------- choice
class Gemm:
    """The GEMM providers of the process (held by the engine's runtime as ``RUNTIME.gemm``): the loaded
    providers and the calibration behind ``auto`` — resources; the *choice* is the configuration's
    (:func:`qkv.config`'s ``gemm``, :func:`set_gemm` its process default), read on every matmul.

    Safe under concurrent callers: loading and calibrating happen under one lock, and :meth:`matmul` reads the
    configuration and one attribute.
    """

    def __init__(self):
        self._lock = threading.Lock()
        #: The first choice: ``auto`` unless the environment variable QKV_GEMM names another (e.g.
        #: ``QKV_GEMM=mkl`` for a script that has no option for it); an unknown name there is ignored with a
        #: warning. In force while the configuration sets no ``gemm``.
        self.initial = _checks.env_choice("QKV_GEMM", PROVIDERS)
        self._numpy = NumpyGemm()
        self._mkl = None                                   # MklGemm once loaded; False: not installed
        self._active = None                                # the provider auto resolved to; None: not yet
        self._exp = None                                   # the provider auto's exp uses (calibrated apart)
        #: The calibration behind ``auto``: ``{"numpy": s, "mkl": s, "shapes": ..., "ms": ...}`` or None.
        self.calibration: dict | None = None

    @property
    def choice(self) -> str:
        """The choice in force here: the configuration's ``gemm`` (:func:`qkv.config`, :func:`set_gemm`), else
        :attr:`initial`. Assigning it sets the process default, unchecked (:meth:`set` checks)."""
        c = _settings.current().gemm
        return self.initial if c is None else c

    @choice.setter
    def choice(self, name: str) -> None:
        _settings.set_default(gemm=None if name == self.initial else name)     # unchecked, as QKV_GEMM is

    # ---------------------------------------------------------------- providers
    def mkl(self):
        """The MKL provider, loaded on first use; None when the ``mkl`` extra is not installed."""
        if self._mkl is None:
            with self._lock:
                if self._mkl is None:
                    path = _mkl_library_path()
                    try:
                        self._mkl = MklGemm(path) if path else False
                    except (OSError, AttributeError):      # a wheel without the library or its symbols
                        self._mkl = False
        return self._mkl or None

    def provider(self, name: str):
        """The provider called ``name`` (``numpy`` or ``mkl``); ValueError for others, or for ``mkl`` when
        its extra is not installed."""
        if name == "numpy":
            return self._numpy
        if name == "mkl":
            p = self.mkl()
            if p is None:
                raise ValueError(f"gemm: 'mkl' needs Intel MKL, which is not installed: {_MKL_INSTALL}")
            return p
        raise ValueError(f"gemm: expected one of {PROVIDERS}, got {name!r}")

    def available(self) -> tuple:
        """The providers installed here."""
        return PROVIDERS if self.mkl() is not None else ("numpy",)

    # ---------------------------------------------------------------- choosing
    def check(self, name: str, what: str = "name") -> str:
        """``name`` if it is a choice that can run here (``"auto"``, ``"numpy"``, ``"mkl"`` with its extra);
        a TypeError/ValueError naming ``what`` otherwise."""
        if not isinstance(name, str):
            raise TypeError(f"{what}: expected a str, one of {('auto',) + PROVIDERS}, got {type(name).__name__}")
        if name not in ("auto",) + PROVIDERS:
            raise ValueError(f"{what}: expected one of {('auto',) + PROVIDERS}, got {name!r}")
        if name != "auto":
            self.provider(name)
        return name

    def set(self, name: str = "auto") -> None:
        """Choose the provider of the process (the configuration's default): ``"auto"`` (calibrated once per
        process), ``"numpy"`` or ``"mkl"``. The environment's choice (:attr:`initial`) is the default's
        not-set state."""
        self.check(name)
        with self._lock:
            if name == "auto" and self.calibration is not None:
                self._apply_calibration()
        _settings.set_default(gemm=None if name == self.initial else name)

    def _apply_calibration(self) -> None:
        cal = self.calibration
        self._active = self._mkl if cal["chosen"] == "mkl" else self._numpy
        self._exp = self._mkl if cal["exp"]["chosen"] == "mkl" else self._numpy

    def get(self) -> str:
        """The provider in use (``"numpy"`` or ``"mkl"``): with ``auto``, what the calibration chose (it runs
        now if it has not yet)."""
        return self.active().name

    def auto_choice(self) -> tuple:
        """What ``auto`` takes here, ``(GEMM provider, exp provider)``, calibrating now if it has not yet
        (whatever the current choice)."""
        mkl = self.mkl()
        if mkl is None:
            return "numpy", "numpy"
        with self._lock:
            if self.calibration is None:
                self.calibration = _calibrate(self._numpy, mkl)
        return self.calibration["chosen"], self.calibration["exp"]["chosen"]

    def exp_provider(self) -> str:
        """The provider of :func:`exp` (``auto`` calibrates it apart from the GEMM: on the AMD EPYC test
        machine NumPy's GEMM but MKL's exp)."""
        if self.choice != "auto":
            return self.active().name
        self._auto()
        return self._exp.name

    def active(self):
        """The provider :meth:`matmul` calls for large products (resolving ``auto`` on first use)."""
        choice = self.choice
        if choice == "auto":
            return self._active if self._active is not None else self._auto()
        return self._named(choice)

    def _named(self, choice: str):
        if choice == "numpy":
            return self._numpy
        mkl = self.mkl()
        if mkl is None:                                    # QKV_GEMM=mkl without the extra
            raise ValueError(f"QKV_GEMM: 'mkl' needs Intel MKL, which is not installed: {_MKL_INSTALL}")
        return mkl

    def _auto(self):
        """``auto`` resolved: NumPy without MKL, else the calibration's choice (calibrating once)."""
        mkl = self.mkl()
        with self._lock:
            if self._active is not None:
                return self._active
            if mkl is None:
                self._active = self._exp = self._numpy
            else:
                if self.calibration is None:
                    self.calibration = _calibrate(self._numpy, mkl)
                self._apply_calibration()
            return self._active

    def matmul(self, a, b, out=None):
        """``a @ b`` (into ``out``) by the chosen provider; ``np.matmul``'s semantics."""
        c = _settings.current().gemm
        choice = self.initial if c is None else c
        if choice != "auto":
            p = self._numpy if choice == "numpy" else self._named(choice)
        else:
            p = self._active
            if p is None:
                p = self._first(a, b)
            elif p is not self._numpy and _flops(a, b) < AUTO_RESOLVE_FLOPS:
                p = self._numpy                            # auto took MKL: small products stay NumPy's
        return p.matmul(a, b, out=out)

    def exp(self, x, out=None):
        """``np.exp(x, out=out)`` by the chosen provider's exp (``auto``'s calibrated apart)."""
        choice = self.choice
        if choice != "auto":
            p = self._named(choice)
        else:
            p = self._exp
            if p is None:
                p = self._numpy if np.size(x) < AUTO_RESOLVE_FLOPS else (self._auto() and self._exp)
        return p.exp(x, out=out)

    def _first(self, a, b):
        """The provider for a matmul asked before ``auto`` is resolved: NumPy for products too small to
        matter (so that small work — the explainer, a short sentence — never loads MKL nor calibrates),
        else the resolved choice."""
        if _flops(a, b) < AUTO_RESOLVE_FLOPS:
            return self._numpy
        return self._auto()


def _flops(a, b) -> int:
    """The multiply-adds of ``a @ b`` as :data:`AUTO_RESOLVE_FLOPS` counts them (``a``'s size times
    ``b``'s last dimension; a scalar ``b`` counts 1, for NumPy's own error)."""
    return np.size(a) * (np.shape(b)[-1] if np.ndim(b) else 1)


#: The context :func:`_calibrate` holds NumPy's BLAS on one thread with. The runtime owns the BLAS limits and
#: installs its counted limit here when it is created (:func:`use_blas_limit`); gemm sits below the engine and
#: never imports it.
_blas_single_threaded = contextlib.nullcontext


def use_blas_limit(limit) -> None:
    """Calibrate under ``limit()`` (a context holding NumPy's BLAS on one thread): the runtime's
    ``blas_single_threaded``, installed by :mod:`qkv.backends.runtime`."""
    global _blas_single_threaded
    _blas_single_threaded = limit


def _calibrate(numpy_p, mkl_p) -> dict:
    """Both providers on :data:`CALIBRATION_SHAPES` in float32, one thread each, alternating, best of
    :data:`_CALIBRATION_REPEATS` in CPU time (``time.thread_time``: what other processes take on a shared
    machine does not count); MKL is chosen when its total is below (1 − AUTO_MARGIN) × NumPy's. Likewise
    ``exp`` over a 1024 × 512 block, chosen apart."""
    t0 = time.perf_counter()
    best = {"numpy": 0.0, "mkl": 0.0}
    rates = {"numpy": [], "mkl": []}
    with _blas_single_threaded(), single_threaded():   # NumPy's BLAS on one thread: the runtime's limit
        for m, k, n in CALIBRATION_SHAPES:
            a = np.full((m, k), 0.5, np.float32)            # the values do not change a GEMM's time
            b = np.full((k, n), 0.25, np.float32)
            c = np.empty((m, n), np.float32)
            times = {"numpy": [], "mkl": []}
            for p in (numpy_p, mkl_p):
                p.matmul(a, b, out=c)                      # warm-up (MKL's first call initializes it)
            for _ in range(_CALIBRATION_REPEATS):
                for p in (numpy_p, mkl_p):
                    t = time.thread_time()
                    p.matmul(a, b, out=c)
                    times[p.name].append(time.thread_time() - t)
            for name, ts in times.items():
                best[name] += min(ts)
                rates[name].append(2 * m * k * n / min(ts) / 1e9)
        # exp over one 1024 × 512 block of scores (the engine's other big pass)
        src = np.linspace(-30, 0, 1024 * 512, dtype=np.float32).reshape(1024, 512)   # scores minus their max
        s = np.empty_like(src)
        times = {"numpy": [], "mkl": []}
        for p in (numpy_p, mkl_p):
            p.exp(src, out=s)
        for _ in range(_CALIBRATION_REPEATS):
            for p in (numpy_p, mkl_p):
                np.copyto(s, src)
                t = time.thread_time()
                p.exp(s, out=s)
                times[p.name].append(time.thread_time() - t)
        exp_best = {name: min(ts) for name, ts in times.items()}
    return {"chosen": _choose(best), "seconds": best, "gflops_per_thread": rates, "shapes": CALIBRATION_SHAPES,
            "exp": {"chosen": _choose(exp_best), "seconds": exp_best, "shape": s.shape},
            "ms": (time.perf_counter() - t0) * 1e3}


def _choose(seconds: dict) -> str:
    """``auto``'s rule: MKL when its calibration time is below (1 − AUTO_MARGIN) × NumPy's, else NumPy."""
    return "mkl" if seconds["mkl"] < (1 - AUTO_MARGIN) * seconds["numpy"] else "numpy"


#: The process's GEMM providers; the engine's runtime holds them as ``RUNTIME.gemm``.
GEMM = Gemm()


def set_gemm(name: str = "auto") -> None:
    """Choose the GEMM provider of the engine and the models — the process default of :func:`qkv.config`'s
    ``gemm`` (a ``with qkv.config(gemm=...)`` block overrides it in its context): ``"auto"`` (the default: MKL where it is
    installed and measured faster on the engine's block shapes, else NumPy), ``"numpy"`` or ``"mkl"``
    (needs ``pip install 'qkv[mkl]'``)."""
    GEMM.set(name)


def get_gemm() -> str:
    """The GEMM provider in use: ``"numpy"`` or ``"mkl"`` (``auto`` resolved; its calibration runs now if
    it has not yet)."""
    return GEMM.get()


def exp(x, out=None):
    """``np.exp(x, out=out)`` by the chosen provider (MKL's vector math for contiguous float32/float64 arrays,
    where ``auto`` measured it faster); the engine's exponentials of a block of scores."""
    return GEMM.exp(x, out=out)


def matmul(a, b, out=None):
    """``a @ b`` by the chosen provider, as ``np.matmul(a, b, out=out)`` (2-D, a matrix times a vector, or
    batches); float32/float64 go to MKL when it is chosen. For the models' projections: ``matmul(x, W)``."""
    return GEMM.matmul(a, b, out=out)
