"""The map code of the offline page (:mod:`qkv.viz.page`): attention weights quantized and entropy-coded.

:class:`qkv.viz.page.MapSet` codes maps with these; :func:`decode_maps` reads them back (as page.js does).
"""
from __future__ import annotations

import base64

import numpy as np

# Attention weights at any size: the canvas views (model, worked examples beyond the playground, generation)
# read "map sets" — every head's weights rounded to MAP_DIGITS decimals and stored exactly as those integers
# (k = round(w·10^d), 0 … 10^d), entropy-coded so that 1,024 tokens × 30 layers × 9 heads fit the page budget.
#
# The code (one "table" per group of maps, one "blob" per map; both base64):
#   symbol   b = bit length of k (0 … NS−1), coded with rANS (12-bit frequencies, 32-bit state, 16-bit words)
#            in the context (b of the cell above, b of the cell to the left); the group's table holds the
#            frequencies of every context, uint16 little-endian, NCTX × NS.
#   raw bits k − 2^(b−1) in b − 1 bits (b ≥ 2), most significant first, packed after the words.
#   blob     uint32 n | n uint16 words | raw bits. Every row of a map is its own rANS stream (its final state,
#            two words, then its renormalisation words in decoding order), so the encoder runs on all rows of a
#            group at once in NumPy; the page decodes one map when it is shown (page.js: decodeMap).
#   rows     a causal map stores cells j ≤ i of row i (the rest are masked: weight 0); others every cell.

#: Decimals of a weight in the canvas views: the hover shows exactly these digits of the weight qkv computed.
MAP_DIGITS = 3
#: The largest side of a thumbnail (max-pooled), in cells.
THUMB = 40

_PROB_BITS = 12
_PROB_SCALE = 1 << _PROB_BITS
_RANS_LOW = 1 << 16


def _symbols(digits: int) -> int:
    return int(10 ** digits).bit_length() + 1


def quantize(weights, digits: int = MAP_DIGITS) -> np.ndarray:
    """The integers ``k`` with ``k / 10**digits`` = each weight rounded to ``digits`` decimals exactly as Python's
    ``format(w, f".{digits}f")`` rounds it (the exact binary value, ties to even); uint16."""
    w = np.asarray(weights)
    if not np.all(np.isfinite(w)):
        raise ValueError("weights: expected finite numbers")
    scale = 10 ** digits
    x = w.astype(np.float64) * scale                     # exact for float32 weights (24 + 14 bits < 53)
    k = np.rint(x)
    if w.dtype != np.float32 and w.dtype != np.float16:  # float64: the product may round onto a tie
        frac = np.abs(x - np.floor(x) - 0.5)
        for idx in zip(*np.nonzero(frac < 1e-6)):
            k[idx] = round(float(format(float(w[idx]), f".{digits}f")) * scale)
    if k.min(initial=0) < 0 or k.max(initial=0) > scale:
        raise ValueError(f"weights: expected attention weights in [0, 1], got {w.min()} … {w.max()}")
    return k.astype(np.uint16)


def _bits(k: np.ndarray) -> np.ndarray:
    """The bit length of each non-negative integer (0 → 0), as int64."""
    return np.frexp(k.astype(np.float64))[1].astype(np.int64)


def _lengths(rows: int, cols: int, causal: bool) -> np.ndarray:
    """Stored cells per row: j ≤ i (top-left causal, as torch's is_causal) or every column."""
    if causal:
        return np.minimum(np.arange(1, rows + 1), cols)
    return np.full(rows, cols)


def _frequencies(counts: np.ndarray) -> np.ndarray:
    """Counts (NCTX, NS) → frequencies summing to 2^12 per context, every symbol at least 1."""
    nctx, ns = counts.shape
    total = counts.sum(axis=1, keepdims=True)
    f = 1 + (counts * (_PROB_SCALE - ns)) // np.maximum(total, 1)
    f[np.arange(nctx), counts.argmax(axis=1)] += _PROB_SCALE - f.sum(axis=1)
    return f.astype(np.int64)


def _encode_group(ks: list[np.ndarray], causal: list[bool], digits: int) -> tuple[bytes, list[bytes]]:
    """One group of maps (quantized, 2-D) → (the group's frequency table, one blob per map). See the code above."""
    ns = _symbols(digits)
    rows = [k.shape[0] for k in ks]
    R, C = sum(rows), max(k.shape[1] for k in ks)
    sym = np.zeros((R, C), np.int16)
    ctx = np.zeros((R, C), np.int16)
    n = np.zeros(R, np.int64)
    raws = []
    r0 = 0
    for k, c in zip(ks, causal):
        r, s = k.shape
        lens = _lengths(r, s, c)
        stored = np.arange(s)[None, :] < lens[:, None]
        b = np.where(stored, _bits(k), 0)
        up = np.zeros_like(b)
        up[1:] = b[:-1]
        left = np.zeros_like(b)
        left[:, 1:] = b[:, :-1]
        sym[r0:r0 + r, :s] = b
        ctx[r0:r0 + r, :s] = up * ns + left
        n[r0:r0 + r] = lens
        sel = stored & (b >= 2)
        nb = b[sel] - 1                                           # raw bits, row-major = decoding order
        off = k[sel].astype(np.int64) - (1 << nb)
        total = int(nb.sum())
        if total:
            cell = np.repeat(np.arange(nb.size), nb)
            pos = np.arange(total) - np.repeat(np.cumsum(nb) - nb, nb)
            bits = (off[cell] >> (nb[cell] - 1 - pos)) & 1
            raws.append(np.packbits(bits.astype(np.uint8)).tobytes())
        else:
            raws.append(b"")
        r0 += r
    valid = np.arange(C)[None, :] < n[:, None]
    counts = np.bincount((ctx.astype(np.int64) * ns + sym)[valid], minlength=ns * ns * ns).reshape(ns * ns, ns)
    freq = _frequencies(counts)
    F = freq.ravel().astype(np.uint64)
    CUM = (np.cumsum(freq, axis=1) - freq).ravel().astype(np.uint64)
    # rANS, all rows at once, symbols last to first; rows sorted by length so the active ones are a prefix.
    order = np.argsort(-n, kind="stable")
    symP, ctxP, nP = sym[order], ctx[order], n[order]
    active = np.searchsorted(-nP, -np.arange(C), side="left")     # rows with n > j
    x = np.full(R, _RANS_LOW, np.uint64)
    e_rows, e_cols, e_words = [], [], []
    for j in range(C - 1, -1, -1):
        a = int(active[j])
        if a == 0:
            continue
        idx = ctxP[:a, j].astype(np.int64) * ns + symP[:a, j]
        f, cf = F[idx], CUM[idx]
        xa = x[:a]
        over = np.nonzero(xa >= (f << np.uint64(20)))[0]          # ((L >> 12) << 16) · f
        if over.size:
            e_rows.append(order[over])
            e_cols.append(np.full(over.size, j, np.int64))
            e_words.append(xa[over] & np.uint64(0xFFFF))
            xa[over] >>= np.uint64(16)
        x[:a] = ((xa // f) << np.uint64(_PROB_BITS)) + xa % f + cf
    state = np.empty(R, np.uint64)
    state[order] = x
    allr = np.concatenate([np.arange(R), np.arange(R)] + e_rows)
    allc = np.concatenate([np.full(R, -2), np.full(R, -1)] + e_cols)
    allw = np.concatenate([state >> np.uint64(16), state & np.uint64(0xFFFF)] + e_words)
    srt = np.lexsort((allc, allr))
    allr, allw = allr[srt], allw[srt].astype("<u2")
    bounds = np.searchsorted(allr, np.cumsum([0] + rows))
    blobs = []
    for m in range(len(ks)):
        words = allw[bounds[m]:bounds[m + 1]]
        blobs.append(np.uint32(words.size).astype("<u4").tobytes() + words.tobytes() + raws[m])
    return freq.astype("<u2").tobytes(), blobs


def _thumb(k: np.ndarray, digits: int) -> np.ndarray:
    """A max-pooled picture of a map, at most THUMB cells a side, uint8 (255 = weight 1)."""
    r, c = k.shape
    f = max(1, -(-max(r, c) // THUMB))
    t = np.maximum.reduceat(np.maximum.reduceat(k, np.arange(0, r, f), axis=0), np.arange(0, c, f), axis=1)
    return np.rint(t.astype(np.float64) * (255 / 10 ** digits)).astype(np.uint8)


def decode_maps(maps: dict) -> list[np.ndarray]:
    """The quantized weights (uint16, ``k / 10**digits``) of every map of ``MapSet.to_json()``: the page's
    decoder written again in Python (slow: for tests and small sets)."""
    ns = maps["ns"]
    out = []
    tables = []
    for t in maps["tables"]:
        f = np.frombuffer(base64.b64decode(t), "<u2").astype(np.int64).reshape(ns * ns, ns)
        tables.append((f, np.cumsum(f, axis=1) - f))
    for blob, g, (r, c), causal in zip(maps["blobs"], maps["table_of"], maps["shapes"], maps["causal"]):
        f, cum = tables[g]
        data = base64.b64decode(blob)
        nw = int(np.frombuffer(data[:4], "<u4")[0])
        words = np.frombuffer(data[4:4 + 2 * nw], "<u2").astype(np.int64)
        raw = np.unpackbits(np.frombuffer(data[4 + 2 * nw:], np.uint8))
        k = np.zeros((r, c), np.int64)
        b = np.zeros((r, c), np.int64)
        p = bp = 0
        for i, n in enumerate(_lengths(r, c, causal)):
            x = int(words[p]) << 16 | int(words[p + 1])
            p += 2
            for j in range(n):
                cx = (b[i - 1, j] if i else 0) * ns + (b[i, j - 1] if j else 0)
                slot = x & (_PROB_SCALE - 1)
                s = int(np.searchsorted(cum[cx], slot, side="right") - 1)
                x = int(f[cx, s]) * (x >> _PROB_BITS) + slot - int(cum[cx, s])
                if x < _RANS_LOW:
                    x = x << 16 | int(words[p])
                    p += 1
                b[i, j] = s
                if s < 2:
                    k[i, j] = s
                else:
                    v = 0
                    for _ in range(s - 1):
                        v = v << 1 | int(raw[bp])
                        bp += 1
                    k[i, j] = (1 << (s - 1)) + v
        out.append(k.astype(np.uint16))
    return out
