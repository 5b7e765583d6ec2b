"""Packed documents on the default engine (issue 39): a document that starts inside a cell whose other rows an
earlier piece of the compiled tile loop already took read its tile from the cell's first row — wrong rows at
every boundary inside a cell. Each case here is held to the float64 reference, forward, lse and backward, on
both block-kernel providers and at one and two threads."""
import numpy as np
import pytest

import qkv
from qkv import mods as M

#: float32 against float64: each side's rounding (the reference's own float32 run is off by up to 7e-7 here)
TOL = 2e-6


def _inputs(L: int, seed: int, heads: int = 2):
    r = np.random.default_rng(seed)
    return tuple(r.standard_normal((1, heads, L, 64), dtype=np.float32) for _ in range(3))


def _check_forward(q, k, v, bm, threads, backend=None):
    out, lse = qkv.flex_attention(q, k, v, None, bm, return_lse=True, backend=backend, threads=threads)
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    ref, ref_lse = qkv.flex_attention(q64, k64, v64, None, bm, return_lse=True, backend="reference")
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, atol=TOL, rtol=0)


def _check_backward(q, k, v, bm, threads, backend=None):
    g = np.random.default_rng(9).standard_normal(q.shape, dtype=np.float32)
    got = qkv.flex_attention_backward(g, q, k, v, None, bm, backend=backend, threads=threads)
    want = qkv.flex_attention_backward(*(a.astype(np.float64) for a in (g, q, k, v)), None, bm, backend="reference")
    for a, b in zip(got, want):
        scale = np.abs(b).max()
        assert np.abs(a - b).max() <= 2e-5 * scale, (np.abs(a - b).max(), scale)


@pytest.fixture(params=["numba", "numpy"])
def provider(request, monkeypatch):
    if request.param == "numba":
        pytest.importorskip("numba")
    from qkv.kernels import KERNELS
    monkeypatch.setattr(KERNELS, "choice", request.param)
    return request.param


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_issue_s_five_documents_match_the_reference(provider, causal, threads):
    L = 1024
    q, k, v = _inputs(L, 5)
    doc = M.document(np.arange(L) // 200)                 # five documents, boundaries inside cells
    bm = qkv.create_block_mask(M.and_masks(M.causal(), doc) if causal else doc, None, None, L, L)
    _check_forward(q, k, v, bm, threads)
    _check_backward(q, k, v, bm, threads)


def test_a_document_starting_inside_a_covered_cell_is_right(provider):
    L = 1024                                              # boundaries at 500 and 900: rows 900–903 were wrong
    ids = np.searchsorted([500, 900], np.arange(L), side="right")
    q, k, v = _inputs(L, 7)
    bm = qkv.create_block_mask(M.and_masks(M.causal(), M.document(ids)), None, None, L, L)
    _check_forward(q, k, v, bm, 2)


@pytest.mark.parametrize("L", [513, 1024, 2047])
def test_random_document_counts_match_the_reference(provider, L):
    r = np.random.default_rng(L)
    for trial in range(2):
        cuts = np.sort(r.choice(np.arange(1, L), size=int(r.integers(1, 12)), replace=False))
        ids = np.searchsorted(cuts, np.arange(L), side="right")
        q, k, v = _inputs(L, trial, heads=1)
        bm = qkv.create_block_mask(M.and_masks(M.causal(), M.document(ids)), None, None, L, L)
        _check_forward(q, k, v, bm, 1 + trial)
        if L < 2047:
            _check_backward(q, k, v, bm, 2)


@pytest.mark.parametrize("L", [200, 300])
def test_short_packed_inputs_on_the_tiled_backend(provider, L):
    ids = np.arange(L) // 37
    q, k, v = _inputs(L, 3)
    bm = qkv.create_block_mask(M.and_masks(M.causal(), M.document(ids)), None, None, L, L)
    _check_forward(q, k, v, bm, 2, backend="tiled")
    _check_backward(q, k, v, bm, 2, backend="tiled")
