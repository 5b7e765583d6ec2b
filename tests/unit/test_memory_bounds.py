"""Memory estimated before it is allocated (issue 40, item 3): the dense paths refuse what this process cannot
have with the engine's "needs about N GiB" ValueError and what to ask for instead; a float mask that is a
broadcast view is read as the values it holds; the lab's counts are bounded by what they imply together."""
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest

import qkv
from qkv import _checks

LIMITED = textwrap.dedent("""
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))     # what this process may have: 3 GiB
    import numpy as np, qkv
    try:
        {call}
    except ValueError as e:
        print("ValueError:", e)
""")


def _limited(call: str) -> str:
    got = subprocess.run([sys.executable, "-c", LIMITED.format(call=call)], capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0, got.stderr[-2000:]
    return got.stdout


@pytest.mark.parametrize("call, what, instead", [
    ("x = np.zeros((45000, 16), np.float32); w = np.eye(16, dtype=np.float32); qkv.attention(x, w, w, w)",
     r"the dense scores \(45000 × 45000\)", "need_weights=False, or chosen rows"),
    ("qkv.MultiHeadAttention(16, 2, seed=0)(np.zeros((1, 28000, 16), np.float32), need_weights=True)",
     r"the weights \(1 × 2 × 28000 × 28000\)", "need_weights=False"),
    ("q = np.zeros((1, 4, 30000, 16), np.float32); qkv.scaled_dot_product_attention(q, q, q, backend='reference')",
     r"the dense scores \(1 × 4 × 30000 × 30000\)", "backend='tiled'"),
])
def test_dense_weights_past_what_the_process_may_have_are_refused_before_allocating(call, what, instead):
    out = _limited(call)
    assert out.startswith("ValueError: query, key: ") and "needs about" in out and instead in out, out
    assert __import__("re").search(what, out), out


def test_the_limit_of_the_process_counts_not_only_the_machine_s():
    out = _limited("print('left', qkv._checks.available_bytes() < 3 * 2**30)")
    assert "left True" in out


def test_a_broadcast_float_mask_is_read_as_the_values_it_holds():
    L = 12000
    q = np.random.default_rng(0).standard_normal((1, 1, L, 16)).astype(np.float32)
    peaks = {}
    for kind, m in (("bool", np.broadcast_to(np.ones((), bool), (L, L))),
                    ("float", np.broadcast_to(np.zeros((), np.float32), (L, L)))):
        tracemalloc.start()
        qkv.scaled_dot_product_attention(q, q, q, attn_mask=m)
        peaks[kind] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks["float"] < peaks["bool"] + (32 << 20), peaks       # was + L² bytes and more (144 MB here)
    assert _checks._float_mask_extent(np.broadcast_to(np.float32(np.inf), (L, L)))[0]


def test_the_scale_experiment_bounds_samples_times_keys():
    from qkv.lab import _scale
    with pytest.raises(ValueError, match=r"samples, keys: 1,048,576 × 1,024 = 1,073,741,824 scores per d_k"):
        _scale.run(samples=1 << 20, keys=1024)
