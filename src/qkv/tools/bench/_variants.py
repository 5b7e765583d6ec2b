"""The attention variants side by side (``qkv bench --variants``, :func:`qkv.bench.variants`)."""
from __future__ import annotations

import math
import statistics
import time

import numpy as np

from qkv.tools.bench._env import _machine, header
from qkv.tools.bench._measure import progress_bar, _thread_counts, matmul_rate
from qkv.tools.bench._sweep import SETTLE_S, _fresh_forward


#: The attention variants' targets (qkv bench --variants): (case, ratio name, numerator, denominator, bound);
#: a bound of None: a ratio reported for what it says, no target; :data:`AT_WORK`: the ratio's work fraction
#: plus 25 % (a variant "at its work fraction": it costs what it computes, and a quarter more).
AT_WORK = "work + 25%"
VARIANT_TARGETS = (
    ("window", "window / qkv full causal", "qkv window", "qkv full causal", 0.15),
    ("window", "sinks + window / qkv full causal", "qkv sinks + window", "qkv full causal", AT_WORK),
    ("window", "prefix LM / qkv full causal", "qkv prefix LM", "qkv full causal", AT_WORK),
    ("window", "window / torch dense mask", "qkv window", "torch dense mask", 1.0),
    ("window", "full causal / full non-causal (0.5 + the diagonal's cost)", "qkv full causal",
     "qkv full non-causal", None),
    ("documents", "packed / separate", "qkv packed documents", "qkv separate calls", 1.05),
    ("mods", "ALiBi / plain", "qkv ALiBi", "qkv plain causal", 1.15),
    ("mods", "softcap / plain", "qkv softcap 50", "qkv plain causal", 1.15),
    ("mods", "RoPE / plain", "qkv RoPE", "qkv plain causal", 1.15),
    ("backward", "flex backward / torch", "qkv flex backward", "torch autograd dense mask", 1.5),
)
#: Peak RSS bound of the long sliding-window forward, MB.
VARIANT_LONG_MB = 2048


def _variant_cases(heads, dim, window_n, window, docs, doc_len, mods_n, backward_n, torch, sinks=4, prefix=None):
    """The cases of :func:`variants`: ``(case, N, {impl: zero-argument callable}, note, {impl: work
    fraction})``, built lazily so that only one case's inputs live at a time. The window case also runs
    ``sinks`` sink keys or'ed with the window, and a prefix LM of ``prefix`` keys (None: N / 8)."""
    from qkv.engine import backends
    from qkv.core import mods, positions
    from qkv.core.blockmask import create_block_mask
    tiled = backends.get("tiled")
    scale = 1 / math.sqrt(dim)

    def window_case():
        return _window_case(tiled, heads, dim, window_n, window, sinks, prefix, torch)

    def documents_case():
        n = docs * doc_len
        q, k, v = _inputs(n, heads, dim)
        bm = create_block_mask(mods.document_from_lengths([doc_len] * docs), None, None, n, n)
        parts = [tuple(np.ascontiguousarray(a[:, :, d * doc_len:(d + 1) * doc_len]) for a in (q, k, v))
                 for d in range(docs)]

        def separate():
            for a, b, c in parts:
                tiled.forward(a, b, c, scale=scale)
        share = _work(bm, n)
        return "documents", n, {"qkv packed documents": lambda: tiled.forward(q, k, v, scale=scale, block_mask=bm),
                                "qkv separate calls": separate}, \
            f"{docs} documents of {doc_len}: one call with a document block mask vs {docs} calls of N = {doc_len}", \
            {"qkv packed documents": share, "qkv separate calls": docs * doc_len ** 2 / (n * n)}

    def mods_case():
        n = mods_n
        q, k, v = _inputs(n, heads, dim)
        alibi = mods.alibi(mods.alibi_slopes(heads))
        cap = mods.softcap(50.0)
        calls = {"qkv plain causal": lambda: tiled.forward(q, k, v, scale=scale, is_causal=True),
                 "qkv ALiBi": lambda: tiled.forward(q, k, v, scale=scale, is_causal=True, score_mod=alibi),
                 "qkv softcap 50": lambda: tiled.forward(q, k, v, scale=scale, is_causal=True, score_mod=cap)}
        note = "causal; ALiBi with the paper's slopes, softcap 50 (Gemma 2)"
        rope = getattr(positions, "rope", None)
        if rope is not None:
            calls["qkv RoPE"] = lambda: tiled.forward(rope(q), rope(k), v, scale=scale, is_causal=True)
            note += ", RoPE = qkv.positions.rope on q and k (timed) then the plain forward"
        else:
            note += "; RoPE skipped: qkv.positions.rope is not there"
        return "mods", n, calls, note, dict.fromkeys(calls, (n * (n + 1) // 2) / (n * n))

    def backward_case():
        n = backward_n
        q, k, v, go = _inputs(n, heads, dim, 4)
        bm = create_block_mask(mods.causal(), None, None, n, n)
        calls = {"qkv flex backward": lambda: tiled.backward(go, q, k, v, scale=scale, block_mask=bm)}
        if torch is not None:
            F = torch.nn.functional
            tq, tk, tv = (torch.from_numpy(a).clone().requires_grad_() for a in (q, k, v))
            tgo = torch.from_numpy(go)
            dense = torch.from_numpy(np.array(np.broadcast_to(bm.dense((1, 1), n, n), (n, n))))

            def torch_backward():
                tq.grad = tk.grad = tv.grad = None
                F.scaled_dot_product_attention(tq, tk, tv, attn_mask=dense).backward(tgo)
            calls["torch autograd dense mask"] = torch_backward
        return "backward", n, calls, "gradients (forward included) with the causal mask mod; torch: autograd " \
                                     "through SDPA with the same mask as a dense bool tensor", \
            {"qkv flex backward": _work(bm, n), "torch autograd dense mask": 1.0}

    return [window_case, documents_case, mods_case, backward_case]


def _window_case(tiled, heads, dim, n, window, sinks, prefix, torch):
    """The window case of :func:`_variant_cases`: a sliding window, sinks or'ed with it and a prefix LM against
    full causal and non-causal attention (and torch with the window as a dense mask)."""
    from qkv.core import mods
    from qkv.core.blockmask import create_block_mask
    scale = 1 / math.sqrt(dim)
    q, k, v = _inputs(n, heads, dim)
    bm = create_block_mask(mods.sliding_window(window), None, None, n, n)
    sw = create_block_mask(mods.or_masks(mods.sinks(sinks), mods.sliding_window(window)), None, None, n, n)
    pre = prefix if prefix is not None else n // 8
    plm = create_block_mask(mods.prefix_lm(pre), None, None, n, n)
    calls = {"qkv window": lambda: tiled.forward(q, k, v, scale=scale, block_mask=bm),
             "qkv sinks + window": lambda: tiled.forward(q, k, v, scale=scale, block_mask=sw),
             "qkv prefix LM": lambda: tiled.forward(q, k, v, scale=scale, block_mask=plm),
             "qkv full causal": lambda: tiled.forward(q, k, v, scale=scale, is_causal=True),
             "qkv full non-causal": lambda: tiled.forward(q, k, v, scale=scale)}
    if torch is not None:
        F = torch.nn.functional
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        dense = torch.from_numpy(np.array(np.broadcast_to(bm.dense((1, 1), n, n), (n, n))))
        calls["torch dense mask"] = lambda: F.scaled_dot_product_attention(tq, tk, tv, attn_mask=dense)
    causal = (n * (n + 1) // 2) / (n * n)
    work = {"qkv window": _work(bm, n), "qkv sinks + window": _work(sw, n), "qkv prefix LM": _work(plm, n),
            "qkv full causal": causal, "qkv full non-causal": 1.0, "torch dense mask": 1.0}
    return "window", n, calls, f"sliding window {window}, causal (BLOCK_SIZE 128); {sinks} sinks or'ed with it; " \
                               f"a prefix LM of {pre}; torch gets the window as a dense (N, N) bool tensor", work


def _inputs(n: int, heads: int, dim: int, k: int = 3) -> list:
    rng = np.random.default_rng(n)
    return [rng.standard_normal((1, heads, n, dim), dtype=np.float32) for _ in range(k)]


def _work(bm, n: int) -> float:
    """The share of the (N, N) scores a block mask allows: what an implementation at its work fraction computes."""
    return float(np.count_nonzero(np.broadcast_to(bm.dense((1, 1), n, n), (n, n)))) / (n * n)


def variants(*, heads: int = 8, dim: int = 64, repeats: int = 5, threads: int | None = None,
             window_n: int = 8192, window: int = 512, docs: int = 8, doc_len: int = 1024, mods_n: int = 4096,
             backward_n: int = 2048, long_n: int | None = 65536, progress: bool = True,
             cases=("window", "documents", "mods", "backward")) -> dict:
    """The attention variants side by side (``qkv bench --variants``), ratios of medians against their
    targets (:data:`VARIANT_TARGETS`); returns a JSON-ready dict ``{"machine", "config", "rows", "ratios",
    "long"}``. Same protocol as :func:`run`: implementations interleaved, each turn a pause, an untimed
    call and a timed one; one thread count for qkv and torch. Each ratio also as the median of its per-turn
    ratios ("paired": the two calls of one turn run seconds apart, so slow swings of a shared machine's load
    cancel). ``cases``: which of window, documents, mods, backward to run. ``long``: one sliding-window
    forward of ``long_n`` tokens in a fresh process, its peak RSS (None: skipped)."""
    from qkv import _checks

    for name, val in (("heads", heads), ("dim", dim), ("repeats", repeats), ("window_n", window_n),
                      ("window", window), ("docs", docs), ("doc_len", doc_len), ("mods_n", mods_n),
                      ("backward_n", backward_n)):
        _checks.positive_int(val, name)
    try:
        import torch
    except ImportError:
        torch = None
    rows, notes = [], {}
    with _thread_counts(threads, torch) as threads:
        rate = matmul_rate(threads, 2048)
        known = ("window", "documents", "mods", "backward")
        for c in cases:
            if c not in known:
                raise ValueError(f"cases: expected some of {','.join(known)}, got {c!r}")
        makers = _variant_cases(heads, dim, window_n, window, docs, doc_len, mods_n, backward_n, torch)
        makers = [m for name, m in zip(known, makers) if name in cases]
        bar = progress_bar(len(makers), progress)
        for make in makers:
            case, n, calls, note, work = make()
            notes[case] = note
            times = _variant_times(calls, repeats)
            for impl, ts in times.items():
                rows.append(dict(case=case, n=n, impl=impl, median_s=statistics.median(ts), times_s=ts,
                                 work_fraction=work.get(impl)))
            del calls
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
    ratios = _variant_ratios(rows, cases)
    result = {"machine": _machine(threads, rate, torch),
              "config": dict(heads=heads, dim=dim, batch=1, dtype="float32", repeats=repeats, threads=threads,
                             window_n=window_n, window=window, docs=docs, doc_len=doc_len, mods_n=mods_n,
                             backward_n=backward_n, cases=list(cases)),
              "notes": notes, "rows": rows, "ratios": ratios}
    if long_n is not None:
        lg = long_window(long_n, heads=heads, dim=dim, window=window, threads=threads)
        lg["met"] = lg["peak_rss_mb"] < VARIANT_LONG_MB
        result["long"] = lg
    return result


def _variant_times(calls: dict, repeats: int) -> dict:
    """Each call run once (warm-up), then ``repeats`` turns of each, interleaved: noise hits all alike."""
    for fn in calls.values():
        fn()                                              # warm-up
    times = {impl: [] for impl in calls}
    for _ in range(repeats):
        for impl, fn in calls.items():
            time.sleep(SETTLE_S)
            fn()                                          # untimed: back to a warm steady state
            t = time.perf_counter()
            fn()
            times[impl].append(time.perf_counter() - t)
    return times


def _variant_ratios(rows, cases) -> list:
    """The ratios of :data:`VARIANT_TARGETS` for the ``cases`` run: of medians, and the median per-turn one."""
    med = {(r["case"], r["impl"]): r["median_s"] for r in rows}
    work = {(r["case"], r["impl"]): r.get("work_fraction") for r in rows}
    turns = {(r["case"], r["impl"]): r["times_s"] for r in rows}
    ratios = []
    for case, what, num, den, bound in VARIANT_TARGETS:
        if case not in cases:
            continue
        if (case, num) not in med or (case, den) not in med:
            ratios.append(dict(case=case, what=what, ratio=None, paired=None,
                               target=None if bound == AT_WORK else bound, met=None, work_fraction=None))
            continue
        ratio = med[(case, num)] / med[(case, den)]
        paired = statistics.median(a / b for a, b in zip(turns[(case, num)], turns[(case, den)]))
        wn, wd = work.get((case, num)), work.get((case, den))
        share = None if wn is None or not wd else wn / wd
        if bound == AT_WORK:
            bound = None if share is None else 1.25 * share
        ratios.append(dict(case=case, what=what, ratio=ratio, paired=paired, target=bound,
                           met=None if bound is None else ratio < bound if bound == 1.0 else ratio <= bound,
                           work_fraction=share))
    return ratios


def long_window(n: int = 65536, *, heads: int = 8, dim: int = 64, window: int = 512,
                threads: int | None = None) -> dict:
    """One sliding-window forward (the tiled engine, a block mask) of ``n`` tokens in a fresh process: its
    time and peak RSS (VmHWM: the child's own address space since exec), the inputs included."""
    return _fresh_forward(
        f"n, h, e, w, th = {n}, {heads}, {dim}, {window}, {threads!r}\n",
        "t = time.perf_counter()\n"
        "bm = create_block_mask(mods.sliding_window(w), None, None, n, n)\n"
        "out = backends.get('tiled').forward(q, k, v, scale=e ** -0.5, block_mask=bm)[0]\n"
        "t = time.perf_counter() - t\n",
        "dict(n=n, heads=h, dim=e, window=w, seconds=t, peak_rss_mb=rss / 2**20, "
        "inputs_mb=4 * q.nbytes / 2**20, scores_would_take_mb=h * n * n * 4 / 2**20, "
        "finite=bool(np.isfinite(out).all()))", "long sliding-window run")


VARIANT_HEADERS = ("variant", "N", "impl", "median ms")


def variants_markdown(result: dict) -> str:
    """The variants' result as Markdown: the times, then the ratios against their targets (for the README)."""
    lines = [header(result), "",
             "| variant | N | impl | median ms |", "|---|---:|---|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['case']} | {r['n']} | {r['impl']} | {r['median_s'] * 1e3:.1f} |")
    lines += ["", "| ratio of medians | measured | per-turn (median) | work fraction | target | met |",
              "|---|---:|---:|---:|---:|---|"]
    for r in result["ratios"]:
        got = "—" if r["ratio"] is None else f"{r['ratio']:.2f}×"
        paired = "—" if r["paired"] is None else f"{r['paired']:.2f}×"
        op = "<" if r["target"] == 1.0 else "≤"
        target = "—" if r["target"] is None else f"{op} {r['target']:.3g}×"
        met = "—" if r["met"] is None else ("yes" if r["met"] else "**no**")
        wf = "—" if r.get("work_fraction") is None else f"{r['work_fraction']:.3f}"
        lines.append(f"| {r['what']} | {got} | {paired} | {wf} | {target} | {met} |")
    if "long" in result:
        lg = result["long"]
        lines.append(f"| N = {lg['n']} window {lg['window']} forward, peak RSS (H = {lg['heads']}, inputs "
                     f"{lg['inputs_mb']:.0f} MB included) | {lg['peak_rss_mb']:.0f} MB | | | < {VARIANT_LONG_MB} MB | "
                     f"{'yes' if lg['met'] else '**no**'} |")
    return "\n".join(lines)


def variants_text(result: dict) -> list[str]:
    """Plain-text lines of the variants' result (the CLI's table when rich is missing)."""
    out = [f"{r['case']:<10} N={r['n']:<6} {r['impl']:<28} {r['median_s'] * 1e3:9.1f} ms" for r in result["rows"]]
    for r in result["ratios"]:
        got = "—" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        got += "" if r["paired"] is None else f" (per turn {r['paired']:.2f}x)"
        got += "" if r.get("work_fraction") is None else f" work {r['work_fraction']:.3f}"
        target = "" if r["target"] is None else \
            f"target {'<' if r['target'] == 1.0 else '<='} {r['target']:.3g}x  {'met' if r['met'] else 'MISSED'}"
        out.append(f"{r['what']:<32} {got:>36}  {target}")
    if "long" in result:
        lg = result["long"]
        out.append(f"N={lg['n']} window {lg['window']} forward: {lg['seconds']:.2f} s, peak RSS "
                   f"{lg['peak_rss_mb']:.0f} MB (target < {VARIANT_LONG_MB} MB: {'met' if lg['met'] else 'MISSED'})")
    return out
