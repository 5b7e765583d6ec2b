"""``qkv bench --accuracy``: how far each path is from float64, per path × dtype × variant.

The differential matrix's problems (:mod:`qkv.accuracy`), drawn by a seeded NumPy generator — case ``c`` is the
variant ``c mod 16`` (:data:`qkv.accuracy.VARIANTS`: plain, causal, causal bottom-right, bool mask, float bias,
gqa, alibi, softcap, alibi+softcap, custom score mod, window, document, prefix lm, streaming, custom mask mod,
sinks) in float32, float64 or float16 in turn, its sizes, leading dims and the engine's moved thresholds drawn —
each run through every path on the same inputs:

* ``reference`` — ``backend="reference"`` (the stages on whole arrays);
* ``tiled/numpy``, ``tiled/numba``, ``tiled/numba+mkl`` — ``backend="tiled"`` with NumPy's passes or numba's
  fused kernels, NumPy's BLAS or MKL (where installed) as the GEMM;
* ``default`` — ``backend=None`` with the process's own choices of kernels and GEMM (``auto``), its size rule
  moved down so that it takes the tiled engine as it does on large inputs;
* ``torch`` — torch's own ``scaled_dot_product_attention`` or (mods, block masks) eager ``flex_attention`` in the
  inputs' dtype, where torch is installed and has the variant (it has no sinks): a comparator for kernel
  authors;
* ``… backward`` — the gradients of each qkv path.

A case's relative error is normwise: ``max|got − ref| / max|ref|`` against :func:`qkv.accuracy.reference`, over
the output (forward rows) or over dq, dk, dv and d sink_logits together (backward rows: the largest difference in
any of them over the largest reference value in any of them). A row gives the largest and the median over its
cases and their number.
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np

from qkv.tools import accuracy as A

__all__ = ["PATHS", "DEFAULT_CASES", "MAX_CASES", "cases", "run", "markdown", "text", "header"]

#: The qkv paths: (name, the spec's route, kernels and GEMM).
QKV_PATHS = (("reference", "reference", "auto", "auto"), ("tiled/numpy", "tiled", "numpy", "numpy"),
             ("tiled/numba", "tiled", "numba", "numpy"), ("tiled/numba+mkl", "tiled", "numba", "mkl"),
             ("default", "default", "auto", "auto"))
PATHS = tuple(p[0] for p in QKV_PATHS) + ("torch",) + tuple(p[0] + " backward" for p in QKV_PATHS)
#: ``--cases`` by default (each variant three times in each dtype: about 30 s on a 2-vCPU Zen 4) and at most.
DEFAULT_CASES = 9 * len(A.VARIANTS)
MAX_CASES = 2000
_GRADS = ("dq", "dk", "dv", "dsink")


def cases(n: int, seed: int = 0) -> list:
    """``n`` specs ``(variant, Spec)``: variant ``c mod 16``, dtype float32/float64/float16 in turn, the rest drawn
    by ``numpy.random.default_rng(seed)``; the engine's limits drawn, ``backend=None``'s size rule moved."""
    rng = np.random.default_rng(seed)
    names = list(A.VARIANTS)
    out = []
    for c in range(n):
        variant = names[c % len(names)]
        spec = A.draw_spec(A.numpy_chooser(rng), variant)
        limits = dict(spec.limits)
        limits.update(dict.fromkeys(A.AUTO_LIMITS, 0))
        out.append((variant, dataclasses.replace(spec, dtype=A.DTYPES[(c // len(names)) % len(A.DTYPES)],
                                                 threads=1, limits=tuple(sorted(limits.items())))))
    return out


def _available_paths() -> list:
    from qkv.compute import gemm
    from importlib.util import find_spec
    have_numba = find_spec("numba") is not None
    have_mkl = "mkl" in gemm.GEMM.available()
    return [p for p in QKV_PATHS if (have_numba or p[2] != "numba") and (have_mkl or p[3] != "mkl")]


def run(n: int = DEFAULT_CASES, *, seed: int = 0, torch: bool = True, progress=None) -> dict:
    """The table: ``{"rows": [{"path", "dtype", "variant", "max_rel_err", "median_rel_err", "cases"}, …]}``, rows
    in the order of :data:`PATHS`, dtypes and variants. ``torch``: include torch's path where it is installed.
    ``progress``: called with no argument after each case."""
    errs: dict = {}
    paths = _available_paths()
    use_torch = torch and _torch() is not None
    for variant, spec in cases(n, seed):
        p = A.build(spec)
        ref = A.reference(p)
        for name, route, kernels, provider in paths:
            run_spec = dataclasses.replace(spec, route=route, kernels=kernels, gemm=provider)
            got = A.run(dataclasses.replace(p, spec=run_spec))
            _add(errs, name, spec, variant, A.relative_errors(got, ref, ("out",)))
            _add(errs, name + " backward", spec, variant, A.relative_errors(got, ref, _GRADS))
        if use_torch:
            out = torch_forward(p)
            if out is not None:
                _add(errs, "torch", spec, variant, A.relative_errors({"out": out}, ref, ("out",)))
        if progress is not None:
            progress()
    order = {name: i for i, name in enumerate(PATHS)}
    variants = {name: i for i, name in enumerate(A.VARIANTS)}
    rows = []
    for (path, dtype, variant), values in sorted(errs.items(), key=lambda kv: (
            order[kv[0][0]], A.DTYPES.index(kv[0][1]), variants[kv[0][2]])):
        rows.append(dict(path=path, dtype=dtype, variant=variant, max_rel_err=float(max(values)),
                         median_rel_err=float(np.median(values)), cases=len(values)))
    return {"rows": rows}


def _add(errs: dict, path: str, spec, variant: str, err: float) -> None:
    errs.setdefault((path, spec.dtype, variant), []).append(err)


# ============================================================================================ torch's path
def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def torch_forward(p: A.Problem):
    """torch's own forward of ``p`` in the inputs' dtype (SDPA for the sdpa API, eager flex_attention for mods and
    block masks), as a NumPy array of the output's shape; None where torch has no such variant (sinks)."""
    torch = _torch()
    spec = p.spec
    if torch is None or spec.sinks or spec.dropout:
        return None
    t = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in (("q", p.q), ("k", p.k), ("v", p.v))}
    lead4 = (1,) * (4 - p.q.ndim)
    q, k, v = (x.reshape(lead4 + tuple(x.shape)) for x in (t["q"], t["k"], t["v"]))
    if spec.kv_batch_one:
        k, v = k.expand((q.shape[0],) + tuple(k.shape[1:])), v.expand((q.shape[0],) + tuple(v.shape[1:]))
    if spec.api == "sdpa":
        mask = None if p.attn_mask is None else torch.from_numpy(np.ascontiguousarray(p.attn_mask))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=p.is_causal,
                                                               scale=p.scale, enable_gqa=p.enable_gqa)
    else:
        out = _torch_flex(torch, p, q, k, v)
    return out.reshape(p.q.shape[:-1] + (p.v.shape[-1],)).numpy()


def _torch_flex(torch, p: A.Problem, q, k, v):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    spec = p.spec
    score_mod = None if spec.score_mod == "none" else _torch_score_mod(torch, p)
    bm = None
    if spec.mask_mod != "none":
        mask_mod = _torch_mask_mod(torch, p)
        bm = create_block_mask(mask_mod, None, None, spec.L, spec.S, device="cpu", BLOCK_SIZE=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                    # "flex_attention called without torch.compile()"
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, scale=p.scale, enable_gqa=p.enable_gqa)


def _torch_score_mod(torch, p: A.Problem):
    name, cap = p.spec.score_mod, p.spec.cap
    if name in ("alibi", "alibi_softcap"):
        mod = p.score_mod if name == "alibi" else p.score_mod.params["mods"][0]
        slopes = torch.from_numpy(mod.params["slopes"])

        def alibi(s, b, h, i, j):
            s = s + (slopes[h] * (j - i)).to(s.dtype)
            return s if name == "alibi" else cap * torch.tanh(s / cap)
        return alibi
    if name == "softcap":
        return lambda s, b, h, i, j: cap * torch.tanh(s / cap)
    if name == "custom_grad":
        return lambda s, b, h, i, j: torch.where(j > i, s * 0.5, s + 0.1 * h.to(s.dtype))
    raise ValueError(f"score_mod: no torch translation of {name!r}")


def _torch_mask_mod(torch, p: A.Problem):
    spec = p.spec
    a, w = spec.mod_arg, max(1, spec.mod_arg)
    if spec.mask_mod == "document":
        ids = torch.from_numpy(p.block_mask.mask_mod.params["doc_ids"])
        return lambda b, h, i, j: ids[i] == ids[j]
    table = {"causal": lambda b, h, i, j: i >= j,
             "sliding_window": lambda b, h, i, j: (i - j >= 0) & (i - j < w),
             "prefix_lm": lambda b, h, i, j: (j < a) | (i >= j),
             "streaming": lambda b, h, i, j: (j < a) | ((i - j >= 0) & (i - j < w)),
             "custom": A.custom_mask}
    if spec.mask_mod not in table:
        raise ValueError(f"mask_mod: no torch translation of {spec.mask_mod!r}")
    return table[spec.mask_mod]


# ================================================================================================= output
def header(n: int, command: str) -> list:
    """The lines above the table: the command, then CPU, NumPy and its BLAS, the GEMM and kernels in use, MKL's
    kernel, numba's and torch's versions (:func:`qkv.bench.environment_line`)."""
    import os
    from qkv.tools import bench
    from qkv.compute import gemm
    lines = [f"`{command}` — {n} cases, relative error max|got − ref| / max|ref| against float64 (normwise)",
             bench.environment_line() + f"; {os.cpu_count()} vCPU"]
    extra = []
    if "mkl" in gemm.GEMM.available():
        extra.append(f"MKL (tiled/numba+mkl): {gemm.GEMM.provider('mkl').kernel()}")
    torch = _torch()
    if torch is not None:
        extra.append(f"torch {torch.__version__}")
    if extra:
        lines.append("; ".join(extra))
    return lines


COLUMNS = ("path", "dtype", "variant", "max rel err", "median rel err", "cases")


def _cells(row: dict) -> list:
    return [row["path"], row["dtype"], row["variant"], _fmt(row["max_rel_err"]), _fmt(row["median_rel_err"]),
            str(row["cases"])]


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else "0" if x == 0 else f"{x:.2e}"


def markdown(result: dict, head: list) -> str:
    """The table as Markdown, under ``head`` (:func:`header`)."""
    lines = [line + "  " for line in head[:-1]] + head[-1:] + [""]
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "|".join(["---"] * 3 + ["---:"] * 3) + "|")
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in result["rows"]]
    return "\n".join(lines)


def text(result: dict, head: list) -> str:
    """The table as aligned plain text, under ``head``."""
    rows = [list(COLUMNS)] + [_cells(r) for r in result["rows"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    body = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in rows]
    return "\n".join(head + [""] + body)
