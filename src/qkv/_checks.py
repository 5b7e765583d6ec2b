"""Validation at the public boundary.

Every public function validates its arguments here, once, and raises ``TypeError`` (wrong kind of thing)
or ``ValueError`` (right kind, wrong value) with a message that names the argument and shows what was
expected and what was found. Nothing here uses ``assert``.
"""
from __future__ import annotations

import types

import math
import os
import numbers

import numpy as np

FLOAT_DTYPES = (np.float16, np.float32, np.float64)


def _describe(x) -> str:
    if isinstance(x, np.ndarray):
        return f"array of shape {x.shape} and dtype {x.dtype}"
    return type(x).__name__


def float_array(x, name: str, *, min_ndim: int = 0, ndim: int | None = None, finite: bool = True,
                extents: dict | None = None) -> np.ndarray:
    """Return ``x`` as a floating NumPy array or raise a clear error.

    Lists of numbers are accepted and become float64; integer/bool arrays are rejected (attention is
    defined on real numbers, and torch rejects them too). ``extents`` (with ``finite``): the finiteness is
    read from the array's max and min (NaN and ±inf reach them), and ``extents[name]`` = max |x| is kept for
    :func:`range_check`, which needs exactly that — two reductions for both checks, no temporary. Where
    ``extents`` holds ``name`` already, the caller read those two as it made the array (finite: checked
    there), and they are not read again.
    """
    if isinstance(x, np.ndarray):
        arr = x
    elif isinstance(x, (list, tuple)) or isinstance(x, numbers.Number):
        try:
            arr = np.asarray(x, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name}: expected a numeric array, got a {type(x).__name__} that is "
                            f"not a rectangular array of numbers ({exc})") from None
    else:
        raise TypeError(f"{name}: expected a numpy.ndarray, got {_describe(x)}")
    if arr.dtype.type not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype float16, float32 or float64, got {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got {arr.ndim} (shape {arr.shape})")
    if arr.ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dimensions, got {arr.ndim} (shape {arr.shape})")
    if finite and extents is not None and arr.size:
        if name in extents:                      # read by the caller as it made the array (finite, max |x|)
            return arr
        m = finite_max_abs(arr)
        if m is not None:
            extents[name] = m
            return arr
    if finite and not np.all(np.isfinite(arr)):
        bad = np.argwhere(~np.isfinite(arr))[0]
        raise ValueError(f"{name}: expected finite numbers, got {arr[tuple(bad)]} at index {tuple(int(i) for i in bad)}")
    return arr


def positive_int(x, name: str, *, minimum: int = 1) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (numbers.Integral,)):
        raise TypeError(f"{name}: expected an integer, got {type(x).__name__} {x!r}")
    if int(x) < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {x}")
    return int(x)


def float_dtype(dtype, name: str = "dtype") -> np.dtype:
    """``dtype`` as a NumPy floating dtype (float16, float32, float64), or a TypeError naming ``name``."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name}: expected a float dtype (float16, float32 or float64), got {dtype!r}") from None
    if dt.type not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a float dtype (float16, float32 or float64), got {dt}")
    return dt


def seed(x, name: str = "seed"):
    """A seed for ``np.random.default_rng``: None, an integer ≥ 0, or a Generator / SeedSequence as is."""
    if x is None or isinstance(x, (np.random.Generator, np.random.SeedSequence)):
        return x
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected None or an integer >= 0, got {type(x).__name__} {x!r}")
    if int(x) < 0:
        raise ValueError(f"{name}: expected None or an integer >= 0, got {x}")
    return int(x)


def available_bytes() -> int | None:
    """Memory this process can have for a new allocation now: the least of the machine's (Linux MemAvailable; else
    physical memory), what the process's address-space limit leaves (``ulimit -v``) and what its cgroup's memory
    limit leaves (a container's); None where none is known."""
    known = [x for x in (_machine_available(), _rlimit_left(), _cgroup_left()) if x is not None]
    return min(known) if known else None


def _machine_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _rlimit_left() -> int | None:
    """RLIMIT_AS less the address space in use (/proc/self/status VmSize), or None (no limit, not Linux)."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/status") as f:
            used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        return max(0, soft - used)
    except (ImportError, OSError, ValueError, StopIteration):
        return None


def _cgroup_left() -> int | None:
    """What this process's cgroup's memory limit leaves (v2: memory.max − memory.current; v1: memory.limit_in_bytes
    − memory.usage_in_bytes, where the process's cgroup is mounted as the hierarchy's root), or None."""
    for limit_file, used_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                   "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            if limit == "max" or int(limit) >= 1 << 60:            # no limit (v1 writes a huge number)
                continue
            with open(used_file) as f:
                return max(0, int(limit) - int(f.read().strip()))
        except (OSError, ValueError):
            continue
    return None


def fits(nbytes: float, what: str, instead: str | None = None) -> None:
    """A ValueError naming ``what`` (the arguments that set the size) when ``nbytes`` cannot be had here —
    a clear message instead of NumPy's MemoryError (or the machine swapping) later; ``instead``: what to do
    instead, said after it."""
    avail = available_bytes()
    if avail is not None and nbytes > avail:
        raise ValueError(f"{what}: needs about {nbytes / 2**30:,.1f} GiB, more than the {avail / 2**30:,.1f} GiB "
                         f"available here" + (f"; {instead}" if instead else ""))


#: What to ask for instead of weights that do not fit (:func:`fits_scores`).
FEWER_WEIGHTS = "ask for fewer weights: need_weights=False, or chosen rows with qkv.attention_weights(..., rows=...)"


def fits_scores(shape: tuple, itemsize: int, copies: int, what: str, instead: str) -> None:
    """:func:`fits` for ``copies`` arrays of the scores' ``shape`` (…, L, S): a ValueError "query, key: ``what``
    (B × H × L × S): needs about N GiB, …; ``instead``" where this process cannot have them."""
    fits(copies * math.prod(shape) * itemsize, f"query, key: {what} ({' × '.join(str(x) for x in shape)})", instead)


def boolean(x, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {type(x).__name__} {x!r}")
    return bool(x)


def compute_dtype(dtype) -> np.dtype:
    """The dtype attention's scores are computed in for inputs of ``dtype``: float64 for float64, else float32
    (float16 inputs are computed in float32)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def mask_array(mask, name: str, dtype=None) -> np.ndarray:
    """A mask is boolean (True = may attend) or floating (added to the scaled scores). ``dtype``: the one the
    scores are computed in (float32 for float16/32 inputs, float64): a float mask's positive values must stay
    within half its largest number (the scores, bounded by :func:`range_check`, are added to them), since the
    cast would make 1e39 (a finite float64) +inf and its row NaN; large negative values only mask more (HF's
    ``finfo.min`` convention) and go to −inf at worst."""
    if not isinstance(mask, np.ndarray):
        if isinstance(mask, (list, tuple)):
            mask = np.asarray(mask)
        else:
            raise TypeError(f"{name}: expected a numpy.ndarray of bool (True = may attend) or float "
                            f"(added to the scores), got {_describe(mask)}")
    if mask.dtype == np.bool_:
        return mask
    if mask.dtype.type in FLOAT_DTYPES:
        bad, top = _float_mask_extent(mask)
        if bad:
            raise ValueError(f"{name}: a float mask may hold finite numbers and -inf, got NaN or +inf")
        if dtype is not None and mask.size:
            limit = float(np.finfo(dtype).max) / 2
            if top > limit:
                at = tuple(int(i) for i in np.unravel_index(int(np.argmax(mask)), mask.shape))
                raise ValueError(f"{name}: expected values up to {limit:.3g} (half of {np.dtype(dtype)}'s largest "
                                 f"number: the scores are computed in {np.dtype(dtype)}), got {top:.6g} at index {at}")
        return mask
    raise TypeError(f"{name}: expected dtype bool (True = may attend) or a float dtype (added to the "
                    f"scores), got {mask.dtype}")


def _float_mask_extent(mask: np.ndarray, chunk: int = 1 << 22) -> tuple[bool, float]:
    """``(any NaN or +inf, the largest value)`` of a float mask, read from the values it holds — a broadcast view's
    stored ones alone (a 4-byte mask broadcast to 60,000 × 60,000 was read as 3.6 billion values, 3.7 GB of
    temporaries) — a chunk of rows at a time."""
    held = mask[tuple(slice(0, 1) if st == 0 and n > 1 else slice(None) for st, n in zip(mask.strides, mask.shape))]
    flat = held.reshape(-1, held.shape[-1]) if held.ndim > 1 else held.reshape(1, -1)
    bad, top = False, -np.inf
    step = max(1, chunk // max(1, flat.shape[1]))
    for r in range(0, flat.shape[0], step):
        part = flat[r:r + step]
        if part.size:
            m = float(np.max(part))                         # NaN propagates: it is "bad" too
            bad = bad or math.isnan(m) or m == math.inf
            top = max(top, m) if not math.isnan(m) else top
    return bad, top


def broadcastable(shape, target, name: str, target_desc: str) -> None:
    try:
        out = np.broadcast_shapes(tuple(shape), tuple(target))
    except ValueError:
        raise ValueError(f"{name}: shape {tuple(shape)} does not broadcast to {target_desc} "
                         f"{tuple(target)}") from None
    if out != tuple(target):
        raise ValueError(f"{name}: shape {tuple(shape)} would broadcast {target_desc} {tuple(target)} "
                         f"up to {out}; expected a shape that broadcasts to {tuple(target)}")


# ---------------------------------------------------------------------------------------------- range
# Finite inputs can still overflow inside attention: float32 q = k = 1e19 gives scores of 1e38 and NaN. The
# bounds below are computed in log10 so that they cannot overflow themselves (1e200 squared is 1e400), from
# the largest |x| first (no copy) and from row norms (a float64 copy) only when that rough bound is too large:
# O((L + S)·E) either way.

#: log10 of the largest magnitude each compute dtype is trusted with: float32 holds 3.4e38 and float64
#: 1.8e308; the headroom (1e37, 1e300) is for the sums over keys and heads on top of the bounded terms.
_LOG10_LIMIT = types.MappingProxyType({np.dtype(np.float32): 37.0, np.dtype(np.float64): 300.0})
#: log10 of how far the tiled engine lets a row's Σ exp(s − m_i) grow per key block before it rescales,
#: exp(LAZY_BOUND = 40): its running sums of p·v reach S·e^40·max |v| before the final division.
_LOG10_SUM_GROWTH = 40.0 / math.log(10.0)


def finite_max_abs(x) -> float | None:
    """max |x| as a Python float from x's max and min (NaN and ±inf reach them; no temporary the size of
    ``x``), or None where either is not finite."""
    hi, lo = float(np.max(x)), float(np.min(x))
    return max(hi, -lo) if math.isfinite(hi) and math.isfinite(lo) else None


def _max_abs(x) -> float:
    """max |x| as a Python float, by max and min: no temporary the size of ``x``."""
    return max(float(np.max(x)), -float(np.min(x)))


def _log10(m: float) -> float:
    return math.log10(m) if m > 0 else -math.inf


def _log10_max_norm(x, m: float) -> float:
    """log10 of the largest row norm ‖x_i‖₂ (rows along the last axis) given m = max |x|: computed on x / m in
    float64, so that the squares can neither overflow nor underflow to 0."""
    if m == 0:
        return -math.inf
    y = np.asarray(x, np.float64) / m                               # max |y| = 1: Σ y² ≤ width
    return math.log10(m) + 0.5 * math.log10(float(np.max(np.einsum("...e,...e->...", y, y))))


def _fmt_log10(x: float) -> str:
    """10**x written like 1e+400 (which a float cannot hold)."""
    e = math.floor(x)
    m = round(10.0 ** (x - e), 1)
    if m >= 10:
        m, e = m / 10, e + 1
    return f"{m:.2g}e{e:+03d}"


def range_check(query, key, value, scale: float, *, grad_out=None, extents: dict | None = None) -> bool:
    """Whether attention on these finite inputs fits its compute dtype (float32 for float16/float32 inputs,
    float64 for float64): ``False`` if so, ``True`` if float16/float32 inputs need float64 (the caller then
    computes in float64 and casts the result back); a ``ValueError`` naming what would overflow when not even
    float64 holds it.

    Bounded: the scores, |q_i·k_j·scale| ≤ max ‖q‖ · max ‖k‖ · |scale| (Cauchy–Schwarz); with ``value``, the
    tiled engine's running sums S·e^40·max |v|; with ``grad_out`` (the backward), the gradients,
    2·L·H·max ‖dO‖ · max ‖v‖ · max(‖q‖, ‖k‖) · |scale| (dS = P ∘ (dP − D) with |dP|, |D| ≤ ‖dO‖·max ‖v‖,
    summed over up to L rows and the H query heads sharing a key) and L·H·max |dO| (dV).

    query (..., Hq, L, E), key (..., Hk, S, E), value (..., Hk, S, Ev) or None, grad_out (..., Hq, L, Ev) or
    None, all finite (checked before). Costs a max and a min per array (none for an array whose max |x|
    ``extents`` holds, by its name, from :func:`float_array`); row norms only when those are large.
    """
    cdt = compute_dtype(query.dtype)
    limit = _LOG10_LIMIT[cdt]
    L, E = query.shape[-2:]
    S = key.shape[-2]
    heads = query.size // (L * E)                  # query heads whose rows sum into one key's gradient
    log_scale = math.log10(abs(scale)) if scale else -math.inf
    arrays = {n: x for n, x in (("query", query), ("key", key), ("value", value),
                                ("grad_out", grad_out)) if x is not None}
    known = extents or {}
    max_abs = {n: known[n] if n in known else _max_abs(x) for n, x in arrays.items()}
    logs = {n: _log10(m) for n, m in max_abs.items()}

    def bounds(norm):
        b = {"scores": norm["query"] + norm["key"] + log_scale}
        if value is not None:
            b["sums"] = math.log10(S) + _LOG10_SUM_GROWTH + logs["value"]
        if grad_out is not None:
            b["gradients"] = max(
                math.log10(2 * L * heads) + norm["grad_out"] + norm["value"] + max(norm["query"], norm["key"])
                + log_scale, math.log10(L * heads) + logs["grad_out"])
        return b

    rough = bounds({n: logs[n] + 0.5 * math.log10(x.shape[-1]) for n, x in arrays.items()})  # ‖x‖ ≤ √E·max|x|
    if max(rough.values()) <= limit:
        return False
    b = bounds({n: _log10_max_norm(x, max_abs[n]) for n, x in arrays.items()})
    worst = max(b, key=b.get)
    if b[worst] <= limit:
        return False
    wide = _LOG10_LIMIT[np.dtype(np.float64)]
    if cdt == np.float32 and b[worst] <= wide:
        return True
    worst = next(n for n in b if b[n] > wide)                       # the scores first: the root cause
    beyond = (f"over the 1e+{wide:.0f} that float64 (up to {np.finfo(np.float64).max:.2g}) leaves the softmax's "
              "sums and the gradients; rescale the inputs")
    if worst == "scores":
        names = "scale" if log_scale > logs["query"] + logs["key"] else "query, key"
        scale_text = f" with scale = {scale:.3g}" if names == "scale" else ""
        raise ValueError(f"{names}: the scores q·k·scale{scale_text} reach about {_fmt_log10(b[worst])} "
                         f"(max ‖q‖·max ‖k‖·|scale|), {beyond}")
    if worst == "sums":
        raise ValueError(f"value: values up to {_fmt_log10(logs['value'])} in the running sums of up to "
                         f"S·e^40 weights reach about {_fmt_log10(b[worst])}, {beyond}")
    raise ValueError(f"grad_out: the gradients reach about {_fmt_log10(b[worst])} "
                     f"(2·L·heads·max ‖dO‖·max ‖v‖·max(‖q‖, ‖k‖)·|scale|), {beyond}")


def env_choice(var: str, choices: tuple, default: str = "auto") -> str:
    """The choice named by environment variable ``var`` when it is one of ``choices``; else ``default`` (a
    ``RuntimeWarning`` naming the variable, the choices and the value when it was set to something else)."""
    env = os.environ.get(var, "").strip()
    if env in choices:
        return env
    if env and env != default:
        import warnings
        # attributed to the variable, not to a line of qkv's source: one line on stderr (the default format
        # prints the source line of a real location under the message)
        warnings.warn_explicit(f"{var}: expected one of {(default,) + tuple(choices)}, got {env!r}; using "
                               f"{default!r}", RuntimeWarning, filename=f"${var}", lineno=0, module="qkv")
    return default
