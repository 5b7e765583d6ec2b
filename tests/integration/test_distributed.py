"""qkv.distributed: ring attention over torch.distributed (gloo on 127.0.0.1), against the single-process engine.

Four processes are started once (torch.multiprocessing spawn, through qkv.distributed.launch): they run the
whole suite as two groups of P = 2 at once ([0, 1] and [2, 3]: group ranks are not global ranks), then as one
group of P = 4, and send back their numbers, so the parent asserts with readable failures; `qkv ring` starts
two more. Everything is bounded: every collective and transfer has a timeout, each launch a deadline after
which its processes are killed.

- forward and backward equal to the single-process engine (fp64 ≤ 1e-12, fp32 ≤ 1e-5), zigzag and
  contiguous, causal and not, GQA, batch 2, return_lse; sliding windows and documents (and steps skipped);
- messages and bytes each rank sends, counted at torch.distributed.isend, against the formula; the
  transfers are posted before the step's compute and waited for after it (overlap);
- bad input: unequal shards, mismatched dtypes, a zigzag length that is not a multiple of 2·P, a rank whose
  input is invalid: one clear error on every rank; a rank that never calls: a RingError after the timeout;
  no process group: a RuntimeError at once;
- shard/unshard, merge_partials, the launcher (`qkv ring`), the explainer's ring trace (en, zh).
"""
import math
import subprocess
import sys
import time

import numpy as np
import pytest

import qkv
from qkv import mods
from qkv.cli import main
from qkv.distributed import shard, unshard
from qkv.merge import merge_partials

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

TIMEOUT = 20.0            # seconds any one wait of the ring may take in these tests
DEADLINE = 90.0           # seconds a launch may take before its processes are killed
E = 8


# ---------------------------------------------------------------------------------------------- workers
def _inputs(N, dtype, H=4, Hk=4, B=2, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, N, E)).astype(dtype)
    k = rng.standard_normal((B, Hk, N, E)).astype(dtype)
    v = rng.standard_normal((B, Hk, N, E)).astype(dtype)
    do = rng.standard_normal((B, H, N, E)).astype(dtype)
    return q, k, v, do


def _single(q, k, v, do, causal, gqa, mod=None):
    """The single-process engine: output, lse, gradients."""
    if mod is None:
        out, lse = qkv.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa, backend="tiled",
                                                    return_lse=True)
        grads = qkv.scaled_dot_product_attention_backward(do, q, k, v, is_causal=causal, enable_gqa=gqa)
        return out, lse, grads
    N = q.shape[-2]
    bm = qkv.create_block_mask(mods.and_masks(mods.causal(), mod) if causal else mod, None, None, N, N)
    out, lse = qkv.flex_attention(q, k, v, block_mask=bm, enable_gqa=gqa, return_lse=True, backend="tiled")
    grads = qkv.flex_attention_backward(do, q, k, v, block_mask=bm, enable_gqa=gqa, backend="tiled")
    return out, lse, grads


class _Recorder:
    """Counts what this rank hands to torch.distributed.isend (messages, bytes, tags) and logs the order of
    posts, engine calls and waits."""

    def __init__(self):
        import torch.distributed as dist

        from qkv.distributed import _plan
        self.sent, self.events = [], []
        self._isend, self._irecv = dist.isend, dist.irecv
        self._fwd, self._bwd = _plan.forward_block, _plan.backward_block
        rec = self

        class Work:
            def __init__(self, w, what):
                self.w, self.what = w, what

            def wait(self, *a, **kw):
                rec.events.append(("wait", self.what))
                return self.w.wait(*a, **kw)

        def isend(tensor, dst=None, group=None, tag=0, **kw):
            rec.sent.append((dst, tag, tensor.numel() * tensor.element_size()))
            rec.events.append(("post", tag))
            return Work(rec._isend(tensor, dst=dst, group=group, tag=tag, **kw), tag)

        def irecv(tensor, src=None, group=None, tag=0, **kw):
            rec.events.append(("post", tag))
            return Work(rec._irecv(tensor, src=src, group=group, tag=tag, **kw), tag)

        def fwd(*a, **kw):
            rec.events.append(("compute", None))
            return rec._fwd(*a, **kw)

        def bwd(*a, **kw):
            rec.events.append(("compute", None))
            return rec._bwd(*a, **kw)
        dist.isend, dist.irecv = isend, irecv
        _plan.forward_block, _plan.backward_block = fwd, bwd

    def take(self):
        out = (list(self.sent), list(self.events))
        self.sent.clear()
        self.events.clear()
        return out


def _err(fn):
    try:
        fn()
    except Exception as exc:                                      # reported to the parent
        return f"{type(exc).__name__}: {exc}"
    return None


def _suite(rank, P, N, group=None):
    """Every case on one process group (``rank`` within it); returns {case: numbers or messages}."""
    from qkv.distributed import ring_attention, ring_attention_backward
    rec = _Recorder()
    res = {"rank": rank}
    kw = dict(timeout=TIMEOUT, group=group)

    def case(name, dtype, layout, causal, H=4, Hk=4, mod=None):
        q, k, v, do = _inputs(N, dtype, H, Hk)
        gqa = H != Hk
        out_ref, lse_ref, g_ref = _single(q, k, v, do, causal, gqa, mod)
        sh = [shard(x, rank, P, layout=layout) for x in (q, k, v, do)]
        st_f, st_b = {}, {}
        out, lse = ring_attention(*sh[:3], is_causal=causal, enable_gqa=gqa, layout=layout, return_lse=True,
                                  mask_mod=mod, stats=st_f, **kw)
        plain = ring_attention(*sh[:3], is_causal=causal, enable_gqa=gqa, layout=layout, mask_mod=mod, **kw)
        sent_f, ev_f = rec.take()
        g = ring_attention_backward(sh[3], *sh[:3], out, lse, is_causal=causal, enable_gqa=gqa, layout=layout,
                                    mask_mod=mod, stats=st_b, **kw)
        sent_b, ev_b = rec.take()
        want = [shard(x, rank, P, layout=layout) for x in (out_ref,) + tuple(g_ref)]
        lse_want = shard(lse_ref, rank, P, layout=layout, seq_dim=-1)
        errs = {"out": float(np.abs(out - want[0]).max()), "plain": float(np.abs(plain - want[0]).max()),
                "lse": float(np.max(np.where(lse == lse_want, 0, np.abs(lse - lse_want)))),
                "dq": float(np.abs(g[0] - want[1]).max()), "dk": float(np.abs(g[1] - want[2]).max()),
                "dv": float(np.abs(g[2] - want[3]).max())}
        res[name] = dict(errs=errs, dtypes=[str(out.dtype)] + [str(x.dtype) for x in g],
                         shapes=[out.shape, lse.shape] + [x.shape for x in g], kv_bytes=sh[1].nbytes + sh[2].nbytes,
                         sent_f=sent_f, sent_b=sent_b, events_f=ev_f, events_b=ev_b, stats_f=st_f, stats_b=st_b)

    for layout in ("zigzag", "contiguous"):
        for causal in (False, True):
            case(f"f64-{layout}-{'causal' if causal else 'full'}", np.float64, layout, causal)
            case(f"f32-gqa-{layout}-{'causal' if causal else 'full'}", np.float32, layout, causal, H=4, Hk=2)
    n = N // P
    case("window-contiguous", np.float64, "contiguous", False, mod=mods.sliding_window(max(2, n - 1)))
    case("window-zigzag-causal", np.float64, "zigzag", True, mod=mods.sliding_window(3))
    case("documents-aligned", np.float64, "contiguous", True, mod=mods.document_from_lengths([n] * P))
    case("documents-zigzag", np.float64, "zigzag", False, mod=mods.document_from_lengths([N // 2 - 3, N // 2 + 3]))

    # bad input: each is one clear error on every rank, and the group stays usable afterwards
    q, k, v, _ = _inputs(N, np.float64)
    sh = [shard(x, rank, P, layout="contiguous") for x in (q, k, v)]
    short = [x[..., :-1, :] if rank == P - 1 else x for x in sh]
    res["bad-unequal"] = _err(lambda: ring_attention(*short, layout="contiguous", **kw))
    mixed = [x.astype(np.float32) if rank == 1 else x for x in sh]
    res["bad-dtype"] = _err(lambda: ring_attention(*mixed, layout="contiguous", **kw))
    odd = [x[..., :n - 1, :] for x in sh]                      # N' = P·(n − 1): not a multiple of 2·P
    res["bad-zigzag-length"] = _err(lambda: ring_attention(*odd, layout="zigzag", **kw))
    nan_q = sh[0].copy()
    if rank == 1:
        nan_q[0, 0, 0, 0] = np.nan
    res["bad-one-rank"] = _err(lambda: ring_attention(nan_q, sh[1], sh[2], layout="contiguous", **kw))
    res["bad-causal-flag"] = _err(lambda: ring_attention(*sh, layout="contiguous", is_causal=rank == 0, **kw))
    res["after-bad"] = float(np.abs(ring_attention(*sh, layout="contiguous", **kw)
                                    - shard(_single(q, k, v, q, False, False)[0], rank, P, layout="contiguous")).max())
    return res


def _staged(rank, P):
    """The ring with every transfer staged through a torch device, as under NCCL (there: the process's CUDA
    device; here "cpu", so that gloo runs the same copies): the same numbers, and every block was staged."""
    import torch

    from qkv.distributed import _ring, ring_attention, ring_attention_backward
    q, k, v, do = _inputs(16, np.float32, 4, 2)
    out_ref, lse_ref, g_ref = _single(q, k, v, do, True, True)
    sh = [shard(x, rank, P) for x in (q, k, v, do)]
    _ring._STAGE_DEVICE = torch.device("cpu")
    try:
        st_f, st_b = {}, {}
        out, lse = ring_attention(*sh[:3], is_causal=True, enable_gqa=True, return_lse=True, stats=st_f,
                                  timeout=TIMEOUT)
        g = ring_attention_backward(sh[3], *sh[:3], out, lse, is_causal=True, enable_gqa=True, stats=st_b,
                                    timeout=TIMEOUT)
    finally:
        _ring._STAGE_DEVICE = None
    want = [shard(x, rank, P) for x in (out_ref,) + tuple(g_ref)]
    return {"err": max(float(np.abs(a - b).max()) for a, b in zip((out,) + tuple(g), want)),
            "staged_f": st_f["staged"], "messages_f": st_f["messages"],
            "staged_b": st_b["staged"], "messages_b": st_b["messages"]}


def _all(rank, world):
    """The launched suite on 4 processes: P = 2 on two groups of 2 at once ([0, 1] and [2, 3], so group ranks
    differ from global ranks), then P = 4 on the default group, then a rank that never calls."""
    import torch.distributed as dist

    from qkv.distributed import ring_attention
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    g = pairs[rank // 2]
    out = {"ring2": _suite(dist.get_rank(g), 2, 16, g), "ring4": _suite(rank, 4, 16)}
    out["staged"] = _staged(rank, 4)
    # a rank that never calls: its peer raises after the timeout (last: that group is broken afterwards)
    sh = [shard(x, rank % 2, 2, layout="contiguous") for x in _inputs(16, np.float64)[:3]]
    t0 = time.monotonic()
    if rank == 0:
        out["absent"] = _err(lambda: ring_attention(*sh, layout="contiguous", timeout=1.0, group=g))
    elif rank == 1:
        time.sleep(1.8)
    out["absent_s"] = time.monotonic() - t0
    return out


CASES = ([f"f64-{lay}-{c}" for lay in ("zigzag", "contiguous") for c in ("full", "causal")]
         + [f"f32-gqa-{lay}-{c}" for lay in ("zigzag", "contiguous") for c in ("full", "causal")]
         + ["window-contiguous", "window-zigzag-causal", "documents-aligned", "documents-zigzag"])


def test_ring_attention_on_2_and_4_processes():
    """One launch for all the cases below (so the processes start once, wherever pytest-xdist runs it)."""
    from qkv.distributed import launch
    launched = launch(_all, 4, timeout=TIMEOUT, deadline=DEADLINE)
    ring2 = [x["ring2"] for x in launched]          # global ranks 0, 1 (group A) and 2, 3 (group B)
    ring4 = [x["ring4"] for x in launched]
    for P, ranks in ((2, ring2), (4, ring4)):
        _check_equal_to_the_single_process_engine(P, ranks)
        _check_messages_and_bytes_per_rank(P, ranks)
        _check_transfers_overlap_the_compute(P, ranks)
        _check_bad_input_is_one_clear_error_on_every_rank(ranks)
    _check_masks_skip_empty_steps_and_stop_the_ring_early(ring4)
    _check_a_rank_that_never_calls_is_an_error_after_the_timeout(launched)
    for res in launched:                          # staged through a device (NCCL's way): same numbers
        st = res["staged"]
        assert st["err"] <= 1e-5, st
        # every message sent and every one received went through the device (a send and a receive a block)
        assert st["staged_f"] == 2 * st["messages_f"] == 2 * 3 and st["staged_b"] == 2 * st["messages_b"] == 2 * 7
    for res in ring4:                             # gloo alone: nothing staged
        assert res["f64-zigzag-causal"]["stats_f"]["staged"] == 0


def _check_equal_to_the_single_process_engine(P, ranks):
    for res in ranks:
        r = res["rank"]
        for name in CASES:
            c = res[name]
            tol = 1e-5 if name.startswith("f32") else 1e-12
            bad = {k: v for k, v in c["errs"].items() if not v <= tol}
            assert not bad, (P, r, name, bad)
            n = 16 // P
            H = 4
            assert c["shapes"][:2] == [(2, H, n, E), (2, H, n)], (name, c["shapes"])
            assert c["shapes"][3] == (2, 2 if "gqa" in name else 4, n, E)         # dK summed over the group
            dt = "float32" if name.startswith("f32") else "float64"
            assert c["dtypes"] == [dt] * 4


def _check_messages_and_bytes_per_rank(P, ranks):
    for i, res in enumerate(ranks):
        r = res["rank"]
        nxt = (r + 1) % P + (i - r)                               # the next rank, as a global rank
        for name in CASES[:8]:
            c = res[name]
            kvb = c["kv_bytes"]                                   # |K| + |V| of one shard, input dtype
            # forward: P − 1 K/V blocks to the next rank, one message each (two forward calls were counted)
            assert c["sent_f"] == [(nxt, 11, kvb)] * (2 * (P - 1)), (name, c["sent_f"])
            assert c["stats_f"]["messages"] == P - 1 and c["stats_f"]["bytes"] == (P - 1) * kvb
            # backward: P − 1 K/V blocks, and P dK/dV accumulators (the last one goes home to its owner)
            kv = [s for s in c["sent_b"] if s[1] == 11]
            dkv = [s for s in c["sent_b"] if s[1] in (12, 13)]
            assert kv == [(nxt, 11, kvb)] * (P - 1)
            assert dkv == [(nxt, 12, kvb)] * (P - 1) + [(nxt, 13, kvb)]
            assert c["stats_b"]["messages"] == 2 * P - 1 and c["stats_b"]["bytes"] == (2 * P - 1) * kvb


def _check_masks_skip_empty_steps_and_stop_the_ring_early(ring4):
    P = 4
    for r, res in enumerate(ring4):
        w = res["window-contiguous"]                                   # window n − 1: this block and the last
        assert w["stats_f"]["steps"] == 2 and w["stats_f"]["messages"] == 1
        assert w["stats_f"]["skipped"] == ([1] if r == 0 else [])
        assert w["stats_b"]["messages"] == 1 + 2                       # 1 K/V block; dK/dV: 1 along + 1 home
        d = res["documents-aligned"]                                   # a document per rank: no ring at all
        assert d["stats_f"]["steps"] == 1 and d["sent_f"] == [] and d["sent_b"] == []
        causal = res["f64-contiguous-causal"]                          # contiguous causal: rank r skips r+1…
        assert causal["stats_f"]["skipped"] == list(range(r + 1, P))
        zig = res["f64-zigzag-causal"]                                 # zigzag: every rank works every step
        assert zig["stats_f"]["skipped"] == [] and zig["stats_f"]["blocks"] == P



def _check_transfers_overlap_the_compute(P, ranks):
    """Each step posts its sends/receives, computes, then waits: the next block travels during the compute; in
    the backward the dK/dV accumulator of a step travels during the next step's compute, and goes home last."""
    post, wait, comp = (lambda tag: ("post", tag)), (lambda tag: ("wait", tag)), ("compute", None)
    fwd = ([post(11), post(11), comp, wait(11), wait(11)] * (P - 1) + [comp]) * 2       # two forward calls
    bwd = [post(11), post(11), comp, post(12), post(12), wait(11), wait(11)]
    bwd += [post(11), post(11), comp, wait(12), wait(12), post(12), post(12), wait(11), wait(11)] * (P - 2)
    bwd += [comp, wait(12), wait(12), post(13), post(13), wait(13), wait(13)]
    for res in ranks:
        c = res["f64-zigzag-causal"]                     # one engine call per step on every rank
        assert c["events_f"] == fwd, c["events_f"]
        assert c["events_b"] == bwd, c["events_b"]


def _check_bad_input_is_one_clear_error_on_every_rank(ranks):
    for res in ranks:
        r = res["rank"]
        assert "shards differ between ranks" in res["bad-unequal"] and "shard" in res["bad-unequal"]
        assert "disagree on dtype" in res["bad-dtype"]
        assert "multiple of 2·P" in res["bad-zigzag-length"] and res["bad-zigzag-length"].startswith("ValueError")
        if r == 1:
            assert res["bad-one-rank"].startswith("ValueError: query: expected finite numbers")
        else:
            assert "rank 1 rejected its input" in res["bad-one-rank"] and "finite" in res["bad-one-rank"]
        assert "disagree on is_causal" in res["bad-causal-flag"]
        assert res["after-bad"] <= 1e-12                               # the group is still usable


def _check_a_rank_that_never_calls_is_an_error_after_the_timeout(launched):
    msg = launched[0]["absent"]
    assert msg is not None and msg.startswith("RingError") and "within 1 s" in msg, msg
    assert 0.9 <= launched[0]["absent_s"] < 5


def test_no_process_group_is_an_error_at_once():
    from qkv.distributed import ring_attention, ring_attention_backward
    x = np.zeros((1, 4, 2))
    import torch.distributed as dist
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialised.*init_process_group"):
        ring_attention(x, x, x)
    with pytest.raises(RuntimeError, match="not initialised"):
        ring_attention_backward(x, x, x, x, x, x[..., 0])


def test_importing_qkv_distributed_does_not_import_torch():
    code = "import sys, qkv, qkv.distributed, qkv.merge; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------- layouts
def test_shard_unshard_layouts():
    x = np.arange(2 * 16 * 3).reshape(2, 16, 3)
    z = [shard(x, r, 2) for r in range(2)]
    assert z[0][0, :, 0].tolist() == [0, 3, 6, 9, 36, 39, 42, 45]    # positions 0–3 and 12–15
    assert np.array_equal(unshard(z), x)
    c = [shard(x, r, 4, layout="contiguous") for r in range(4)]
    assert np.shares_memory(c[1], x) and c[1][0, :, 0].tolist() == [12, 15, 18, 21]
    assert np.array_equal(unshard(c, layout="contiguous"), x)
    lse = np.arange(16.0)
    assert np.array_equal(unshard([shard(lse, r, 4, seq_dim=-1) for r in range(4)], seq_dim=-1), lse)
    assert shard(lse, 3, 4, seq_dim=0).tolist() == [6.0, 7.0, 8.0, 9.0]


def test_shard_says_what_length_is_required():
    with pytest.raises(ValueError, match=r"2·P = 8 equal chunks.*multiple of 8; got N = 12: pad it to 16.*"
                                         r"layout='contiguous'"):
        shard(np.zeros((12, 2)), 0, 4)
    with pytest.raises(ValueError, match="multiple of 4; got N = 10"):
        shard(np.zeros((10, 2)), 0, 4, layout="contiguous")
    with pytest.raises(ValueError, match=r"rank: expected 0 … world_size − 1 = 1, got 2"):
        shard(np.zeros((8, 2)), 2, 2)
    with pytest.raises(ValueError, match="layout: expected one of 'zigzag', 'contiguous'"):
        shard(np.zeros((8, 2)), 0, 2, layout="striped")
    with pytest.raises(ValueError, match="same shape"):
        unshard([np.zeros((4, 2)), np.zeros((2, 2))])
    with pytest.raises(ValueError, match="seq_dim"):
        shard(np.zeros((8, 2)), 0, 2, seq_dim=2)


# ---------------------------------------------------------------------------------------------- merge
def test_merge_partials_is_attention_over_the_union_of_the_keys():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 12, 4)) * 3 for _ in range(3))
    full, lse = qkv.scaled_dot_product_attention(q, k, v, return_lse=True, backend="reference")
    parts = [qkv.scaled_dot_product_attention(q, k[:, a:b], v[:, a:b], return_lse=True, backend="reference")
             for a, b in ((0, 5), (5, 9), (9, 12))]
    o, l_ = merge_partials(*parts[0], *parts[1])
    o, l_ = merge_partials(o, l_, *parts[2])
    assert np.allclose(o, full, atol=1e-13) and np.allclose(l_, lse, atol=1e-13)
    o2, l2 = merge_partials(*parts[2], *merge_partials(*parts[1], *parts[0]))     # any order
    assert np.allclose(o2, full, atol=1e-13) and np.allclose(l2, lse, atol=1e-13)


def test_merge_partials_handles_rows_that_saw_nothing():
    a = np.array([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]])
    la = np.array([0.5, -np.inf, -np.inf])
    b = np.array([[5.0, 6.0], [7.0, 8.0], [0.0, 0.0]])
    lb = np.array([-np.inf, 2.0, -np.inf])
    o, l_ = merge_partials(a, la, b, lb)
    assert np.array_equal(o, [[1, 2], [7, 8], [0, 0]]) and l_.tolist() == [0.5, 2.0, -np.inf]
    big = merge_partials(a[:1], np.array([800.0]), b[:1], np.array([800.0]))       # no overflow
    assert np.allclose(big[0], [[3, 4]]) and np.isclose(big[1][0], 800 + math.log(2))
    acc, acc_l = a.copy(), la.copy()
    merge_partials(acc, acc_l, b, lb, out=(acc, acc_l))                            # in place
    assert np.array_equal(acc, o) and np.array_equal(acc_l, l_)
    with pytest.raises(ValueError, match="merge_partials"):
        merge_partials(a, la, b[:2], lb[:2])


# ---------------------------------------------------------------------------------------------- qkv ring
def test_qkv_ring_launcher_checks_against_one_process(capsys):
    rc = main(["ring", "--nproc", "2", "--length", "64", "--heads", "2", "--dim", "8", "--causal", "--check",
               "--backward", "--timeout", str(TIMEOUT)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "P=2" in out and "zigzag" in out and "step" in out
    assert "sent 1 K/V message" in out and "check: OK" in out, out


def test_qkv_ring_bad_input_is_one_line(capsys):
    for args, what in ((["--nproc", "4", "--length", "12"], "multiple of 8"),
                       (["--nproc", "0", "--length", "16"], "--nproc"),
                       (["--nproc", "2", "--length", "16", "--heads", "4", "--kv-heads", "3"], "--kv-heads")):
        rc = main(["ring"] + args)
        out, err = capsys.readouterr()
        assert rc == 2 and err.count("\n") == 1 and what in err, (args, err)


# ---------------------------------------------------------------------------------------------- trace
def test_trace_ring_equals_the_single_process_result():
    from qkv.distributed import trace_ring
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((12, 3)) for _ in range(3))
    for P, layout, causal, mod in ((2, "zigzag", True, None), (3, "contiguous", False, None),
                                   (2, "contiguous", False, mods.sliding_window(3))):
        tr = trace_ring(q, k, v, P, is_causal=causal, layout=layout, mask_mod=mod)
        assert tr.max_error <= 1e-12, (P, layout)
        assert len(tr.steps) == tr.n_steps <= P
    tr = trace_ring(q, k, v, 2, layout="contiguous", mask_mod=mods.sliding_window(3))
    assert tr.n_steps == 2


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_qkv_explain_ring_trace(lang, capsys):
    rc = main(["explain", "--ring", "2", "--lang", lang])
    out, err = capsys.readouterr()
    assert rc == 0, err
    from qkv.locales import t
    assert t("ring.title", lang, P=2) in out
    assert "log(" in out and "−∞" in out                                    # the merge, written out
    rc = main(["explain", "--example", "sliding_window", "--ring", "2", "--layout", "contiguous", "--lang", lang,
               "--format", "json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    import json
    doc = json.loads(out)
    assert doc["lang"] == lang and len(doc["sections"]) >= 4


def test_qkv_explain_ring_bad_input_is_one_line(capsys):
    for args, key in ((["--ring", "2", "--example", "seed003"], "ring.length"),
                      (["--ring", "2", "--example", "seed002"], "ring.needs_qkv"),
                      (["--ring", "2", "--example", "softcap"], "ring.unsupported"),
                      (["--ring", "0"], None), (["--layout", "zigzag"], "ring.layout_alone")):
        rc = main(["explain"] + args)
        out, err = capsys.readouterr()
        assert rc == 2 and err.count("\n") == 1, (args, err)
