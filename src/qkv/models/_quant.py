"""Weight matrices kept as a GGUF file stores them: :class:`QuantMatrix`, the file's blocks of quantized
weights (uint8, one row of blocks per output row) multiplied without a float32 copy of the matrix.

A decoding step multiplies one row by every weight matrix: memory-bound, so the time is the bytes read.
SmolLM2-135M's Q4_1 matrices and Q8_0 embeddings are 97 MB as stored, 540 MB as float32. :meth:`QuantMatrix.matmul`:

* few rows (≤ :data:`MATVEC_ROWS`, numba installed): one compiled pass over the bytes, each block
  dequantized in registers and multiplied at once, the output rows spread over numba's threads
  (:mod:`._quant_jit`);
* more rows (a prompt): bands of output rows (:data:`BAND_BYTES` of float32) dequantized into a tile, each
  multiplied by BLAS (``x @ tile.T``), so that a prompt stays about as fast as with float32 weights;
* without numba, the bands are dequantized by NumPy (correct, slower).

The types: F32, Q4_0, Q4_1, Q8_0 (blocks of 32 weights), Q4_K and Q6_K (super-blocks of 256); the layouts are
ggml's (``ggml-common.h``), dequantized with the operations of ``gguf.quants.dequantize``, so that
:meth:`QuantMatrix.dequantize` equals gguf's bit for bit. Nothing here imports gguf.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import types
from dataclasses import dataclass

import numpy as np

from qkv.compute import gemm
from qkv.engine.backends.runtime import RUNTIME

__all__ = ["BAND_BYTES", "BLAS_THREAD_ROWS", "INT8_TYPES", "MATVEC_ROWS", "TYPES", "QuantMatrix", "QuantStack",
           "matmul", "round_rows", "stack_rows", "type_name"]

#: type name → (ggml type id, weights per block, bytes per block, kernel kind code)
TYPES = types.MappingProxyType({
    "F32": (0, 1, 4, 0), "Q4_0": (2, 32, 18, 1), "Q4_1": (3, 32, 20, 2), "Q8_0": (8, 32, 34, 3),
    "Q4_K": (12, 256, 144, 4), "Q6_K": (14, 256, 210, 5)})
_BY_ID = types.MappingProxyType({v[0]: k for k, v in TYPES.items()})
#: At most this many rows of ``x`` go through the compiled one-pass kernel; more are multiplied by BLAS on
#: dequantized bands (on one thread the two took the same time at 4–6 rows of SmolLM2's matrices).
MATVEC_ROWS = 4
#: A band's float32 tile holds about this many bytes (rows of the output, at least 16): wide bands keep BLAS's
#: GEMMs efficient (a 512-token prefill of SmolLM2 on 2 workers, the fastest of 5: 1.20 s with 4 MiB, 1.57 s with
#: 1 MiB, 1.08 s with float32 weights).
BAND_BYTES = 4 << 20
#: Fewer rows of ``x`` than this multiply the bands with BLAS on one thread: their GEMMs are too small for
#: BLAS's threads, whose start and wait per GEMM cost more (a 30-token prefill of SmolLM2 on 2 busy cores:
#: 0.2–0.3 s on one BLAS thread, 1.4–5.7 s on two).
BLAS_THREAD_ROWS = 64
#: the types that multiply 8-bit activations (``activations="int8"``), as llama.cpp's Q8_1 and Q8_0 dot products
INT8_TYPES = ("Q4_1", "Q8_0")
_PARALLEL = threading.Lock()        # one parallel kernel at a time (numba's workqueue layer is not thread-safe)


@functools.cache
def _kernels():
    """:mod:`._quant_jit` (imported once), or None without numba."""
    try:
        from qkv.models import _quant_jit
    except ImportError:
        return None
    return _quant_jit


def type_name(qtype) -> str:
    """``qtype`` (a name such as ``"Q4_1"``, a ggml type id, or gguf's ``GGMLQuantizationType``) as its name."""
    name = getattr(qtype, "name", qtype)
    if isinstance(name, (int, np.integer)) and not isinstance(name, bool):
        name = _BY_ID.get(int(name), name)
    if not isinstance(name, str):
        raise TypeError(f"qtype: expected a type name, ggml type id or GGMLQuantizationType, got "
                        f"{type(qtype).__name__}")
    if name not in TYPES:
        raise ValueError(f"qtype: expected one of {sorted(TYPES)}, got {name!r}")
    return name


@dataclass(frozen=True, slots=True)
class QuantMatrix:
    """A weight matrix W (out, in) as stored: ``data`` (out, in / block · bytes per block) uint8, the file's
    blocks row by row (read-only), ``qtype`` its type name, ``shape`` (out, in).

    ``matmul(x)`` is ``x @ W.T`` (a Linear layer's product) in float32; ``dequantize()`` is W. ``activations``:
    ``"float32"`` multiplies x as given; ``"int8"`` (Q4_1 and Q8_0 only) rounds x to 8 bits per block of 32 first,
    and multiplies as llama.cpp does (:mod:`._quant_q8`).
    """

    data: np.ndarray
    qtype: str
    shape: tuple
    activations: str = "float32"

    def __post_init__(self):
        name = type_name(self.qtype)
        _, bs, ts, _ = TYPES[name]
        shape = self.shape
        if (not isinstance(shape, tuple) or len(shape) != 2
                or not all(isinstance(n, (int, np.integer)) and n > 0 for n in shape)):
            raise ValueError(f"shape: expected (out, in), two positive ints, got {shape!r}")
        out, k = int(shape[0]), int(shape[1])
        if k % bs:
            raise ValueError(f"shape: {name} stores rows in blocks of {bs} weights, got in = {k}")
        data = self.data
        if not isinstance(data, np.ndarray):
            raise TypeError(f"data: expected a uint8 numpy array, got {type(data).__name__}")
        if data.dtype != np.uint8 or data.shape != (out, k // bs * ts):
            raise ValueError(f"data: expected uint8 of shape {(out, k // bs * ts)} ({name}, shape {(out, k)}), "
                             f"got {data.dtype} {data.shape}")
        view = np.ascontiguousarray(data).view()
        view.flags.writeable = False
        object.__setattr__(self, "data", view)
        object.__setattr__(self, "qtype", name)
        object.__setattr__(self, "shape", (out, k))
        if self.activations not in ("float32", "int8"):
            raise ValueError(f"activations: expected one of ('float32', 'int8'), got {self.activations!r}")
        if self.activations == "int8" and name not in INT8_TYPES:
            raise ValueError(f"activations: 'int8' multiplies {INT8_TYPES} weights, got {name}")

    def __repr__(self) -> str:
        act = ", int8 activations" if self.activations == "int8" else ""
        return f"QuantMatrix({self.qtype}, shape {self.shape}, {self.nbytes:,} bytes{act})"

    def with_activations(self, activations: str) -> "QuantMatrix":
        """The same bytes, multiplied with ``activations`` (``"float32"`` or ``"int8"``)."""
        return QuantMatrix(self.data, self.qtype, self.shape, activations)

    @property
    def nbytes(self) -> int:
        """The bytes one multiplication reads: the stored blocks."""
        return int(self.data.nbytes)

    @property
    def _layout(self) -> tuple[int, int]:
        """(weights per block, kernel kind code)."""
        _, bs, _, kind = TYPES[self.qtype]
        return bs, kind

    def dequantize(self) -> np.ndarray:
        """W (out, in) float32, equal to ``gguf.quants.dequantize`` of the same bytes."""
        return self._band(0, self.shape[0])

    def take(self, ids) -> np.ndarray:
        """The rows ``ids`` (any shape of ints) of W, dequantized: (*ids.shape, in) float32 — an embedding
        lookup that dequantizes only the looked-up rows."""
        ids = np.asarray(ids)
        flat = ids.reshape(-1)
        if not flat.size:
            return np.empty(ids.shape + (self.shape[1],), np.float32)
        rows = QuantMatrix(self.data[flat], self.qtype, (flat.size, self.shape[1])).dequantize()
        return rows.reshape(ids.shape + (self.shape[1],))

    def permute_rows(self, order) -> "QuantMatrix":
        """A new matrix whose row i is this one's row ``order[i]`` (whole rows of blocks move)."""
        order = np.asarray(order)
        if order.shape != (self.shape[0],) or not np.array_equal(np.sort(order), np.arange(self.shape[0])):
            raise ValueError(f"order: expected a permutation of 0 … {self.shape[0] - 1}, got {order.shape} "
                             f"{order.dtype} values")
        return QuantMatrix(self.data[order], self.qtype, self.shape, self.activations)

    def _band(self, r0: int, r1: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows r0 … r1 − 1 of W, float32 (into ``out`` when given)."""
        k = self.shape[1]
        if out is None:
            out = np.empty((r1 - r0, k), np.float32)
        if self.qtype == "F32":
            out[...] = self.data[r0:r1].view(np.float32)
            return out
        bs, kind = self._layout
        jit = _kernels()
        if jit is not None:
            jit.dequantize_rows(kind, bs, self.data, r0, r1, out)
        else:
            out[...] = _dequantize_numpy(self.data[r0:r1], self.qtype, k)
        return out

    def matmul(self, x, out: np.ndarray | None = None) -> np.ndarray:
        """``x @ W.T``: x (…, in) float32 → (…, out) float32 (into ``out`` when given)."""
        x = np.asarray(x)
        if x.dtype != np.float32:
            raise TypeError(f"x: expected float32, got {x.dtype}")
        if x.ndim < 1 or x.shape[-1] != self.shape[1]:
            raise ValueError(f"x: expected (…, {self.shape[1]}), got {x.shape}")
        shape = x.shape[:-1] + (self.shape[0],)
        if out is not None and (out.shape != shape or out.dtype != np.float32):
            raise ValueError(f"out: expected float32 {shape}, got {out.dtype} {out.shape}")
        direct = out is not None and out.flags.c_contiguous
        y = self._matmul2(x.reshape(-1, self.shape[1]), out.reshape(-1, shape[-1]) if direct else None)
        if out is None:
            return y.reshape(shape)
        if not direct:
            out[...] = y.reshape(shape)
        return out

    def _matmul2(self, x: np.ndarray, y: np.ndarray | None) -> np.ndarray:
        """x (n, in) → y (n, out), C-contiguous."""
        n, (m, k) = x.shape[0], self.shape
        if y is None:
            y = np.empty((n, m), np.float32)
        if self.qtype == "F32":
            return np.matmul(x, self.data.view(np.float32).T, out=y)
        jit = _kernels()
        if jit is not None and 0 < n <= MATVEC_ROWS:
            bs, kind = self._layout
            x = np.ascontiguousarray(x)
            chunks = min(_threads(), m)
            q8 = _q8_kernels() if self.activations == "int8" else None
            if chunks > 1 and _PARALLEL.acquire(blocking=False):
                try:
                    if q8 is None:
                        jit.matvec_par(kind, bs, self.data, x, y, chunks)
                    else:
                        q8.matvec_q8(kind, self.data, x, y, chunks)
                finally:
                    _PARALLEL.release()
            elif q8 is None:
                jit.matvec(kind, bs, self.data, x, y, 0, m)
            else:
                q8.matvec_q8(kind, self.data, x, y, 1)
            return y
        if self.activations == "int8":                  # a prompt: x rounded as the kernels round it
            x = round_rows(x)
        band = min(max(16, BAND_BYTES // (4 * k)), m)
        tile = RUNTIME.scratch(band, k, np.float32, "quant_tile")   # per thread, reused call to call
        part = RUNTIME.scratch(n, band, np.float32, "quant_part")
        with RUNTIME.blas_single_threaded() if n < BLAS_THREAD_ROWS else contextlib.nullcontext():
            for r0 in range(0, m, band):
                r1 = min(r0 + band, m)
                t = self._band(r0, r1, tile[:r1 - r0])
                if r1 - r0 == band:
                    np.matmul(x, t.T, out=part)
                    y[:, r0:r1] = part
                else:
                    y[:, r0:r1] = x @ t.T
        return y


@functools.cache
def _q8_kernels():
    """:mod:`._quant_q8` (imported once), or None without numba."""
    try:
        from qkv.models import _quant_q8
    except ImportError:
        return None
    return _quant_q8


def round_rows(x: np.ndarray) -> np.ndarray:
    """x (n, k) float32 rounded to 8 bits per block of 32 as llama.cpp rounds activations (x86's
    ``quantize_row_q8_1``): ``q = round(x · (127 / max|x|))`` to nearest even, times ``f16(max|x| / 127)``."""
    q8 = _q8_kernels()
    x = np.ascontiguousarray(x, np.float32)
    if q8 is not None:
        return q8.round_rows(x, np.empty_like(x))
    b = x.reshape(x.shape[0], -1, 32)
    a = np.abs(b).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(a != 0, np.float32(127.0) / a, np.float32(0.0)).astype(np.float32)
    d = (a / np.float32(127.0)).astype(np.float16).astype(np.float32)
    return (np.rint(b * inv) * d).reshape(x.shape)


def _threads() -> int:
    """numba threads for one multiplication: the engine's thread count (:func:`qkv.get_num_threads`), at most
    numba's; 1 inside the engine's workers (they are the parallelism)."""
    if RUNTIME.in_worker():
        return 1
    return max(1, min(RUNTIME.get_num_threads(), _kernels().MAX_THREADS))


def _dequantize_numpy(data: np.ndarray, name: str, k: int) -> np.ndarray:
    """Rows of blocks (n, bytes) → (n, k) float32 in NumPy, with gguf's operations."""
    _, bs, ts, _ = TYPES[name]
    n = data.shape[0]
    b = data.reshape(n, k // bs, ts)

    def half(lo: int) -> np.ndarray:
        return np.ascontiguousarray(b[..., lo:lo + 2]).view(np.float16).astype(np.float32)   # (n, nb, 1)

    def nibbles(q: np.ndarray) -> np.ndarray:                      # (..., 16·c) bytes → (..., 32·c) lows, highs
        q = q.reshape(q.shape[:-1] + (-1, 1, 32 if name == "Q4_K" else 16))
        return np.concatenate([q & 15, q >> 4], axis=-2).reshape(q.shape[:-3] + (-1,))

    if name == "Q4_0":
        w = half(0) * (nibbles(b[..., 2:]).astype(np.float32) - np.float32(8))
    elif name == "Q4_1":
        w = half(0) * nibbles(b[..., 4:]).astype(np.float32) + half(2)
    elif name == "Q8_0":
        w = b[..., 2:].view(np.int8).astype(np.float32) * half(0)
    elif name == "Q4_K":
        w = _q4_k_numpy(b, half(0), half(2), nibbles(b[..., 16:]))
    else:
        w = _q6_k_numpy(b, half(208))
    return w.reshape(n, k)


def _q4_k_numpy(b: np.ndarray, d: np.ndarray, dmin: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K blocks (n, nb, 144): (d·scale)·q − dmin·min per sub-block of 32."""
    s = b[..., 4:16].astype(np.int32)
    lo, hi, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (top & 15) | ((lo >> 6) << 4)], -1).astype(np.float32)       # (n, nb, 8)
    mn = np.concatenate([hi & 63, (top >> 4) | ((hi >> 6) << 4)], -1).astype(np.float32)
    q = q.reshape(q.shape[:-1] + (8, 32)).astype(np.float32)
    return (d * sc)[..., None] * q - (dmin * mn)[..., None]


def _q6_k_numpy(b: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q6_K blocks (n, nb, 210): (d·scale)·(q − 32) per 16 weights, q = 4 low bits (ql) | 2 high bits (qh)."""
    lead = b.shape[:-1]
    ql = b[..., :128].reshape(lead + (2, 1, 64)) >> np.array([0, 4], np.uint8).reshape(2, 1)
    ql = (ql & 15).reshape(lead + (2, 4, 32))                      # (half, k, l): ql byte 64n + l + 32(k & 1)
    qh = b[..., 128:192].reshape(lead + (2, 1, 32)) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    qh = (qh & 3).reshape(lead + (2, 4, 32))
    q = (ql | (qh << 4)).astype(np.float32) - np.float32(32)
    sc = d * b[..., 192:208].view(np.int8).astype(np.float32)     # (n, nb, 16)
    return (sc[..., None] * q.reshape(lead + (16, 16))).reshape(lead + (256,))


class QuantStack:
    """Quantized matrices of different types stacked by rows (one matrix to the caller: a fused projection
    whose parts the file stores in different types): ``matmul`` writes each part's columns."""

    __slots__ = ("parts", "shape")

    def __init__(self, parts):
        parts = tuple(parts)
        if not parts or len({p.shape[1] for p in parts}) != 1:
            raise ValueError(f"parts: expected matrices with one input width, got {[p.shape for p in parts]}")
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])

    def __repr__(self) -> str:
        return f"QuantStack({', '.join(repr(p) for p in self.parts)})"

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self) -> np.ndarray:
        return np.concatenate([p.dequantize() for p in self.parts])

    def matmul(self, x, out: np.ndarray | None = None) -> np.ndarray:
        x = np.asarray(x)
        if out is None:
            out = np.empty(x.shape[:-1] + (self.shape[0],), np.float32)
        o = 0
        for p in self.parts:
            out[..., o:o + p.shape[0]] = p.matmul(x)
            o += p.shape[0]
        return out


def stack_rows(parts) -> QuantMatrix | QuantStack:
    """The matrices ``parts`` (one input width) stacked by rows: one :class:`QuantMatrix` when they share a
    type (their bytes concatenated), else a :class:`QuantStack`."""
    parts = list(parts)
    if len({(p.qtype, p.shape[1], p.activations) for p in parts}) == 1:
        return QuantMatrix(np.concatenate([p.data for p in parts]), parts[0].qtype,
                           (sum(p.shape[0] for p in parts), parts[0].shape[1]), parts[0].activations)
    return QuantStack(parts)


def matmul(x: np.ndarray, w, out: np.ndarray | None = None) -> np.ndarray:
    """A model's projection of rows x (…, in) by a weight: float32 ``w`` in qkv's (in, out) layout through
    :func:`qkv.gemm.matmul` (``x @ w``), or a :class:`QuantMatrix` / :class:`QuantStack` W (out, in)
    (``x @ W.T``). One call for both, so the models' code is the same whichever they hold."""
    if isinstance(w, (QuantMatrix, QuantStack)):
        return w.matmul(x, out=out)
    return gemm.matmul(x, w, out=out)
