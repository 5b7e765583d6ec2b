"""Ring attention over ``torch.distributed``: exact forward and backward, one tiled-engine call per block.

Forward (Liu et al. 2023; ring-flash-attention; PyTorch's context parallel). Every rank holds its shard of
Q, K and V (layouts in :mod:`qkv.distributed._layout`). At step s rank r holds the K/V block of rank
r − s: it posts ``isend`` of that block to rank r + 1 and ``irecv`` of the next one from rank r − 1, computes
its queries against the held block with the tiled engine (``return_lse``), merges the partial result into its
running output by log-sum-exp (:func:`qkv.merge.merge_partials`, the one merge), and only then waits for the
transfer — so the next block travels while this one is computed. K and V travel as one message (one
contiguous buffer; NumPy and torch share it through ``torch.from_numpy``, no copies; under NCCL, which
moves CUDA tensors only, staged through the process's CUDA device): P − 1 messages of
``(|K| + |V|)·itemsize`` bytes per rank, fewer when a mask leaves the last steps empty for every rank.

Backward (FlashAttention-2 in a ring): each rank keeps its queries, dO, the final output O and log-sum-exp;
the K/V blocks travel as in the forward and their gradients travel *with* them: at step s a rank adds its
share of dK, dV for the held block (``P = exp(S − lse)`` recomputed from the final lse) to the accumulator
that arrived with the block and passes it on; after the last step the accumulator goes to the block's owner.
dQ stays home. Messages per rank: S − 1 K/V blocks and S dK/dV blocks (S the steps run; none of either for
S = 1), the dK/dV ones in the compute dtype.

Before the ring starts, one small collective (an ``all_gather`` of a fixed-size int64 record: shapes,
dtype, layout, flags, scale, the last step each rank needs, and a failing rank's message) checks that every
rank called with matching inputs, so a bad input is one clear error on every rank and not a hang. Every
wait has a timeout (``timeout`` seconds, default :data:`DEFAULT_TIMEOUT`).
"""
from __future__ import annotations

import types

import math
import time
import zlib

import numpy as np

from qkv import _checks
from qkv.core import shapes
from qkv.core.merge import merge_partials
from qkv.integrations.distributed import _layout, _plan

#: Seconds any one wait of the ring (the check collective, a transfer) may take before it is an error.
DEFAULT_TIMEOUT = 120.0
#: Message tags: K/V blocks, dK/dV accumulators along the ring, the accumulators' last hop home.
TAG_KV, TAG_DKV, TAG_HOME = 11, 12, 13

_DTYPES = types.MappingProxyType({np.dtype(np.float16): 1, np.dtype(np.float32): 2, np.dtype(np.float64): 3})
_MSG_BYTES = 480
_NDIM = 8


#: Stage every transfer through this torch device (None: through the process's CUDA device under NCCL,
#: not at all under gloo). Tests set "cpu" to run the staging on gloo; nothing else needs it.
_STAGE_DEVICE = None


class RingError(RuntimeError):
    """A ring that cannot go on: a rank that timed out or whose peer failed (the process group is then not
    reusable)."""


# ---------------------------------------------------------------------------------------------- comm
class _Comm:
    """Point-to-point transfers and the check collective on a process group, every wait bounded, with
    message and byte counts."""

    def __init__(self, group, timeout, fn: str):
        self.fn = fn
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            raise ImportError(f"{fn}: needs torch (torch.distributed): pip install 'qkv[torch]'") from None
        if not dist.is_available():
            raise RuntimeError(f"{fn}: this torch build has no torch.distributed")
        if not dist.is_initialized():
            raise RuntimeError(f"{fn}: the default process group is not initialised; call "
                               "torch.distributed.init_process_group('gloo', …) on every rank first (or start "
                               "the processes with qkv.distributed.launch / qkv ring)")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group: expected a torch.distributed.ProcessGroup or None (the default group), got "
                            f"{type(group).__name__}")
        if timeout is None:
            timeout = DEFAULT_TIMEOUT
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        import datetime
        self.torch, self.dist, self.group = torch, dist, group
        self.timeout = float(timeout)
        self.td = datetime.timedelta(seconds=self.timeout)
        self.rank = dist.get_rank(group)
        # NCCL moves CUDA tensors only: the engine's NumPy blocks are staged through the process's current
        # CUDA device (a copy there before a send, a copy back after a receive); gloo sends them as they are.
        self.device = _STAGE_DEVICE
        if self.device is None and dist.get_backend(group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.rank < 0:
            raise RuntimeError(f"{fn}: this process is not a member of the given group")
        self.size = dist.get_world_size(group)
        self.messages = 0
        self.bytes = 0
        self.wait_s = 0.0
        self.staged = 0                                           # tensors staged through self.device

    def global_rank(self, r: int) -> int:
        if self.group is None or self.group is self.dist.group.WORLD:
            return r
        return self.dist.get_global_rank(self.group, r)

    def _tensor(self, arr: np.ndarray, fill: bool):
        t = self.torch.from_numpy(arr)
        if self.device is None:
            return t                                              # shares arr's memory: no copy
        self.staged += 1
        return t.to(self.device, copy=True) if fill else self.torch.empty(t.shape, dtype=t.dtype, device=self.device)

    def isend(self, arr: np.ndarray, dst: int, tag: int):
        self.messages += 1
        self.bytes += arr.nbytes
        t = self._tensor(arr, True)
        return (self.dist.isend(t, dst=self.global_rank(dst), group=self.group, tag=tag), "send", dst, tag, t, None)

    def irecv(self, arr: np.ndarray, src: int, tag: int):
        t = self._tensor(arr, False)
        return (self.dist.irecv(t, src=self.global_rank(src), group=self.group, tag=tag), "receive", src, tag, t,
                None if self.device is None else arr)

    def wait(self, op):
        if op is None:
            return
        work, what, peer, tag, t, home = op
        t0 = time.perf_counter()
        try:
            work.wait(self.td)
            if home is not None:                                  # staged on a device: back into the array
                np.copyto(home, t.cpu().numpy())
        except RuntimeError as exc:
            kind = {TAG_KV: "K/V block", TAG_DKV: "dK/dV block", TAG_HOME: "dK/dV block"}.get(tag, "message")
            what = f"the {what} of a {kind} {'to' if what == 'send' else 'from'} rank {peer}"
            raise RingError(self._failed(what, time.perf_counter() - t0, exc)) from None
        finally:
            self.wait_s += time.perf_counter() - t0

    def _failed(self, what: str, waited: float, exc: BaseException) -> str:
        """A failed wait, said as what happened: a timeout when it took the whole timeout, else another rank
        that went away (its connection closed) — with torch's own words, cut short."""
        if waited < 0.9 * self.timeout:
            why = (f"failed after {waited:.1f} s, before the {self.timeout:g} s timeout: another rank stopped or "
                   "crashed (its own error says why)")
        else:
            why = f"did not complete within {self.timeout:g} s (does every rank of the group call {self.fn}?)"
        torch_says = " ".join(str(exc).split())
        if len(torch_says) > 160:
            torch_says = torch_says[:159] + "…"
        return (f"{self.fn}: rank {self.rank}: {what} {why}; the process group cannot be reused "
                f"(torch: {torch_says})")

    def all_gather(self, rec: np.ndarray) -> np.ndarray:
        """Every rank's int64 record, (P, len(rec)); bounded by the timeout."""
        torch = self.torch
        mine = torch.from_numpy(np.ascontiguousarray(rec, dtype=np.int64))
        if self.device is not None:
            mine = mine.to(self.device)
        outs = [torch.zeros_like(mine) for _ in range(self.size)]
        t0 = time.perf_counter()
        try:
            work = self.dist.all_gather(outs, mine, group=self.group, async_op=True)
            work.wait(self.td)
        except RuntimeError as exc:
            raise RingError(self._failed("the check before the ring", time.perf_counter() - t0, exc)) from None
        return np.stack([o.cpu().numpy() for o in outs])


# ---------------------------------------------------------------------------------------------- checks
class _Args:
    """One rank's validated arguments."""


def _encode(msg: str) -> np.ndarray:
    b = np.frombuffer(msg.encode("utf-8")[:_MSG_BYTES], np.uint8)
    out = np.zeros(_MSG_BYTES, np.int64)
    out[:b.size] = b
    return out


def _decode(row: np.ndarray) -> str:
    b = bytes(int(x) for x in row if x)
    return b.decode("utf-8", errors="replace")


def _shape_rec(shape: tuple) -> list[int]:
    return [len(shape)] + list(shape) + [0] * (_NDIM - len(shape))


def _validate(fn, query, key, value, is_causal, scale, enable_gqa, layout, mask_mod, world_size, extra=None,
              threads=None):
    """Local checks of one rank (no communication): an _Args, or raises TypeError/ValueError."""
    a = _Args()
    if threads is not None:
        _checks.positive_int(threads, "threads")
    a.query = _checks.float_array(query, "query", min_ndim=2)
    a.key = _checks.float_array(key, "key", min_ndim=2)
    a.value = _checks.float_array(value, "value", min_ndim=2)
    for name, x in (("query", a.query), ("key", a.key), ("value", a.value)):
        if x.ndim > _NDIM:
            raise ValueError(f"{name}: expected at most {_NDIM} dimensions, got shape {x.shape}")
        if 0 in x.shape:
            raise ValueError(f"{name}: expected no empty dimension, got shape {x.shape}")
    if not (a.query.dtype == a.key.dtype == a.value.dtype):
        raise TypeError(f"query, key, value: expected one dtype, got {a.query.dtype}, {a.key.dtype}, {a.value.dtype}")
    a.layout = _layout.check_layout(layout)
    _checks.boolean(is_causal, "is_causal")
    _checks.boolean(enable_gqa, "enable_gqa")
    a.is_causal, a.enable_gqa = bool(is_causal), bool(enable_gqa)
    n, E = a.query.shape[-2:]
    S, Ek = a.key.shape[-2:]
    if Ek != E:
        raise ValueError(f"key: expected last dimension E={E} (the query's width), got {Ek}")
    if a.value.shape[-2] != S or a.key.shape[:-2] != a.value.shape[:-2]:
        raise ValueError(f"value: expected the key's leading dimensions and rows {a.key.shape[:-1]}, got "
                         f"{a.value.shape}")
    if S != n:
        raise ValueError(f"key: ring attention is self-attention over one sharded sequence, so the key shard "
                         f"needs the query shard's {n} rows; got {S}")
    if enable_gqa:
        if a.query.ndim < 3 or a.key.ndim < 3 or a.query.shape[-3] % a.key.shape[-3]:
            raise ValueError(f"enable_gqa: the number of query heads must be a multiple of the key/value heads; "
                             f"got query {a.query.shape}, key {a.key.shape}")
    try:
        a.lead = shapes.lead(a.query.shape, a.key.shape, a.enable_gqa)
    except ValueError:
        raise ValueError(f"key: leading dimensions {a.key.shape[:-2]} do not broadcast with the query's "
                         f"{a.query.shape[:-2]}") from None
    if a.layout == "zigzag" and n % 2:
        raise ValueError(f"{fn}: layout='zigzag' shards hold two equal chunks, so the local length must be even "
                         f"(the global length a multiple of 2·P = {2 * world_size}); got {n} rows per rank "
                         f"(N = {n * world_size}); use shard(x, rank, P, layout=...) to split the sequence")
    if scale is None:
        a.scale = 1.0 / math.sqrt(E)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
            or not math.isfinite(float(scale)):
        raise ValueError(f"scale: expected a finite number or None (= 1/√E), got {scale!r}")
    else:
        a.scale = float(scale)
    a.n, a.N = n, n * world_size
    a.mod = _plan.effective_mod(a.is_causal, mask_mod)
    if mask_mod is not None:
        B = math.prod(a.lead[:-1]) if len(a.lead) > 1 else None
        a.mod.validate(B, a.lead[-1] if a.lead else None, a.N, a.N)
    a.mod_id = 0 if mask_mod is None else zlib.crc32(repr(a.mod).encode()) & 0x7FFFFFFF
    a.wide = _checks.range_check(a.query, a.key, a.value, a.scale, grad_out=extra)
    return a


def _check(comm: _Comm, fn: str, build, extra_shapes=()):
    """Run the local checks (``build()`` → _Args), gather every rank's record, and raise the same way on
    every rank when any rank failed or the ranks disagree. Returns ``(args, records)``."""
    args, err = None, None
    try:
        args = build()
    except (TypeError, ValueError) as exc:
        err = exc
    rec = np.zeros(64 + _MSG_BYTES, np.int64)
    if err is not None:
        rec[0] = 1
        rec[64:] = _encode(f"{type(err).__name__}: {err}")
    else:
        fields = (_shape_rec(args.query.shape) + _shape_rec(args.key.shape) + _shape_rec(args.value.shape)
                  + [_DTYPES[args.query.dtype], _layout.LAYOUTS.index(args.layout), int(args.is_causal),
                     int(args.enable_gqa), int(np.float64(args.scale).view(np.int64)), args.mod_id,
                     args.last, int(args.wide)])
        for shp in extra_shapes(args) if callable(extra_shapes) else ():
            fields += _shape_rec(shp)
        rec[1:1 + len(fields)] = fields
    recs = comm.all_gather(rec)
    bad = [r for r in range(comm.size) if recs[r, 0]]
    if bad:
        if err is not None:
            raise err
        r = bad[0]
        raise ValueError(f"{fn}: rank {r} rejected its input, so no rank starts the ring: {_decode(recs[r, 64:])}")
    names = ["query", "key", "value"]
    block = 1 + _NDIM
    agree = np.ones(63, bool)
    agree[3 * block + 6:3 * block + 8] = False     # the last step, float64 widening: data-dependent, max / any
    for r in range(1, comm.size):
        a, b = recs[0, 1:64], recs[r, 1:64]
        diff = np.flatnonzero((a != b) & agree)
        if not diff.size:
            continue
        k = int(diff[0])
        if k < 3 * block:
            nm = names[k // block]
            raise ValueError(f"{fn}: the shards differ between ranks: rank 0 has {nm} {_shape(recs[0], k // block)}, "
                             f"rank {r} has {_shape(recs[r], k // block)}; every rank needs an equal share of the "
                             f"sequence in the same shapes (qkv.distributed.shard gives them)")
        what = ["dtype", "layout", "is_causal", "enable_gqa", "scale", "mask_mod"]
        i = k - 3 * block
        if i < len(what):
            raise ValueError(f"{fn}: the ranks disagree on {what[i]} (rank 0 and rank {r} differ); call it with the "
                             "same arguments on every rank")
        j = (i - 8) // block
        raise ValueError(f"{fn}: the ranks disagree on the shape of argument {('grad_out', 'out', 'lse')[j]} "
                         f"(rank 0 and rank {r})")
    return args, recs


def _shape(rec: np.ndarray, which: int) -> tuple:
    base = 1 + which * (1 + _NDIM)
    nd = int(rec[base])
    return tuple(int(x) for x in rec[base + 1:base + 1 + nd])


def _plan_at(a, s: int) -> list:
    """The blocks this rank computes at step s (empty: nothing to compute)."""
    return a.plans[s] if s < len(a.plans) else []


def _ring_dtypes(a, recs) -> tuple:
    """``(n_steps, cdt, xdt)`` from every rank's record: the steps any rank needs (not yet at least 1), the
    compute dtype and the dtype that travels (float64 for both when any rank's input needs widening)."""
    n_steps = int(recs[:, 1 + 3 * (1 + _NDIM) + 6].max()) + 1
    wide = bool(recs[:, 1 + 3 * (1 + _NDIM) + 7].any())
    in_dt = a.query.dtype
    cdt = np.dtype(np.float64 if (in_dt == np.float64 or wide) else np.float32)
    xdt = np.dtype(np.float64) if wide else in_dt                     # what travels
    return n_steps, cdt, xdt


def _kv_buffers(a, xdt) -> tuple:
    """Two K/V message buffers (K then V, flat), the first holding this rank's block; and |K|."""
    nk, nv = math.prod(a.key.shape), math.prod(a.value.shape)
    bufs = [np.empty(nk + nv, xdt), np.empty(nk + nv, xdt)]
    bufs[0][:nk] = a.key.reshape(-1)
    bufs[0][nk:] = a.value.reshape(-1)
    return bufs, nk


def _split_kv(buf: np.ndarray, nk: int, a) -> tuple:
    """The K and V views of a K/V message buffer (or of a dK/dV accumulator)."""
    return buf[:nk].reshape(a.key.shape), buf[nk:].reshape(a.value.shape)


def _post_kv(comm: _Comm, cur: np.ndarray, nxt: np.ndarray, s: int, n_steps: int) -> list:
    """Post step s's K/V transfer (send the held block on, receive the next) unless it is the last step."""
    if s + 1 < n_steps:                                   # the next block travels while this one computes
        P, rank = comm.size, comm.rank
        return [comm.isend(cur, (rank + 1) % P, TAG_KV), comm.irecv(nxt, (rank - 1) % P, TAG_KV)]
    return []


def _wait_all(comm: _Comm, ops) -> None:
    for op in ops:
        comm.wait(op)


def _forward_step(a, q, cur, nk, plan, acc, acc_lse, threads) -> int:
    """Compute this rank's queries against the held K/V block and merge into the running output by
    log-sum-exp. Returns the number of blocks computed."""
    k, v = _split_kv(cur, nk, a)
    for blk in plan:
        o, lse = _plan.forward_block(q, k, v, blk, scale=a.scale, enable_gqa=a.enable_gqa, threads=threads)
        rows = slice(blk.q0, blk.q1)
        a_out, a_lse = acc[..., rows, :], acc_lse[..., rows]
        merge_partials(a_out, a_lse, o, lse, out=(a_out, a_lse))
    return len(plan)


def _fill_stats(stats, comm: _Comm, n_steps, compute_s, wait_s, skipped, blocks=None) -> None:
    if stats is None:
        return
    stats.clear()
    stats.update(steps=n_steps, messages=comm.messages, bytes=comm.bytes, staged=comm.staged,
                 compute_s=compute_s, wait_s=wait_s, skipped=skipped)
    if blocks is not None:
        stats["blocks"] = blocks
    stats.update(world_size=comm.size, rank=comm.rank)


# ---------------------------------------------------------------------------------------------- forward
def ring_attention(query, key, value, *, is_causal=False, scale=None, enable_gqa=False, layout="zigzag",
                   group=None, return_lse=False, mask_mod=None, timeout=None, threads=None, stats=None):
    """Exact attention over a sequence sharded across the ranks of a process group, K/V passed in a ring.

    Called on every rank with that rank's shards (``qkv.distributed.shard``); returns that rank's shard of
    ``scaled_dot_product_attention(Q, K, V)`` of the whole sequence (and of its log-sum-exp).

    Args:
        query: (..., Hq, n, E) this rank's queries, n = N / P, in ``layout``.
        key, value: (..., Hk, n, E) / (..., Hk, n, Ev) this rank's keys and values, the same positions.
        is_causal: causal over the *global* positions (top-left; query i sees keys 0 … i).
        scale: multiplier of the scores; None means 1/√E.
        enable_gqa: Hk may divide Hq (grouped-query).
        layout: ``"zigzag"`` (default; balanced causal work) or ``"contiguous"``.
        group: a ``torch.distributed`` process group (None: the default group, which must be initialised).
        return_lse: also return the log-sum-exp of each row, (..., Hq, n), in the compute dtype.
        mask_mod: a :mod:`qkv.mods` mask mod on global positions (``sliding_window(w)``, ``document(ids)``,
            ``and_masks``…; True = may attend), and-ed with ``is_causal``. Steps whose blocks it leaves empty
            are skipped, and the ring stops after the last step any rank needs.
        timeout: seconds any one wait may take (default 120): a rank that never comes is an error, not a hang.
        threads: the tiled engine's workers in this process (default :func:`qkv.get_num_threads`).
        stats: a dict to fill with what happened: ``steps`` (run), ``messages``/``bytes`` (sent by this rank),
            ``compute_s``/``wait_s`` per step, ``skipped`` (steps with nothing to compute here), ``blocks``.

    Returns:
        output (..., Hq, n, Ev) in the input dtype; ``(output, lse)`` with ``return_lse``.

    Raises:
        TypeError/ValueError — the same on every rank — for bad or mismatched inputs (checked with one small
        collective first); RuntimeError when the process group is not initialised; RingError when a wait
        times out or a peer fails.
    """
    fn = "ring_attention"
    _checks.boolean(return_lse, "return_lse")
    comm = _Comm(group, timeout, fn)
    P, rank = comm.size, comm.rank

    def build():
        a = _validate(fn, query, key, value, is_causal, scale, enable_gqa, layout, mask_mod, P, threads=threads)
        a.plans = _plan.plans(rank, P, a.n, a.layout, a.is_causal, a.mod, a.lead)
        a.last = _plan.last_step(a.plans)
        return a
    a, recs = _check(comm, fn, build)
    n_steps, cdt, xdt = _ring_dtypes(a, recs)
    q = a.query.astype(cdt, copy=False)
    bufs, nk = _kv_buffers(a, xdt)
    acc = np.zeros(a.lead + (a.n, a.value.shape[-1]), cdt)
    acc_lse = np.full(a.lead + (a.n,), -np.inf, cdt)
    compute_s, wait_s, skipped = [], [], []
    n_blocks = 0
    for s in range(max(n_steps, 1)):
        cur, nxt = bufs[s % 2], bufs[(s + 1) % 2]
        ops = _post_kv(comm, cur, nxt, s, n_steps)
        t0 = time.perf_counter()
        plan = _plan_at(a, s)
        if plan:
            n_blocks += _forward_step(a, q, cur, nk, plan, acc, acc_lse, threads)
        else:
            skipped.append(s)
        compute_s.append(time.perf_counter() - t0)
        w0 = comm.wait_s
        _wait_all(comm, ops)
        wait_s.append(comm.wait_s - w0)
    _fill_stats(stats, comm, n_steps, compute_s, wait_s, skipped, blocks=n_blocks)
    out = acc.astype(a.query.dtype, copy=False)
    return (out, acc_lse) if return_lse else out


# ---------------------------------------------------------------------------------------------- backward
def _backward_args(fn, grad_out, query, key, value, out, lse, is_causal, scale, enable_gqa, layout, mask_mod,
                   rank, P, threads):
    """The local checks of :func:`ring_attention_backward` (no communication): an _Args with its plans."""
    a = _validate(fn, query, key, value, is_causal, scale, enable_gqa, layout, mask_mod, P, threads=threads)
    expected = shapes.output_shape(a.query.shape, a.key.shape, a.value.shape, a.enable_gqa)
    a.grad_out = _checks.float_array(grad_out, "grad_out", min_ndim=2)
    a.out = _checks.float_array(out, "out", min_ndim=2)
    a.lse = _checks.float_array(lse, "lse", min_ndim=1, finite=False)
    for name, x, want in (("grad_out", a.grad_out, expected), ("out", a.out, expected),
                          ("lse", a.lse, expected[:-1])):
        if x.shape != want:
            raise ValueError(f"{name}: expected shape {want} (this rank's output rows), got {x.shape}")
    if a.grad_out.dtype != a.query.dtype:
        raise TypeError(f"grad_out: expected dtype {a.query.dtype} (as query), got {a.grad_out.dtype}")
    if np.isnan(a.lse).any() or np.isposinf(a.lse).any():
        raise ValueError("lse: expected finite values or −inf (a row that sees no key), as ring_attention "
                         "returns them")
    a.wide = a.wide or _checks.range_check(a.query, a.key, a.value, a.scale, grad_out=a.grad_out)
    a.plans = _plan.plans(rank, P, a.n, a.layout, a.is_causal, a.mod, a.lead)
    a.last = _plan.last_step(a.plans)
    return a


def _backward_step(a, ins, cur, nk, plan, threads) -> list:
    """This rank's share of the gradients for the held K/V block: ``[(blk, (dq, dk, dv)), …]``."""
    do, q, o, lse_ = ins
    k, v = _split_kv(cur, nk, a)
    return [(blk, _plan.backward_block(do, q, k, v, o, lse_, blk, scale=a.scale, enable_gqa=a.enable_gqa,
                                       threads=threads)) for blk in plan]


def _accumulate(a, grads, dq, acc, nk) -> None:
    """Add the step's gradients: dQ to this rank's, dK/dV to the accumulator travelling with the block."""
    dk_acc, dv_acc = _split_kv(acc, nk, a)
    for blk, (g_q, g_k, g_v) in grads:
        dq[..., blk.q0:blk.q1, :] += g_q
        dk_acc[..., blk.k0:blk.k1, :] += g_k
        dv_acc[..., blk.k0:blk.k1, :] += g_v


def _post_dkv(comm: _Comm, acc, other, s: int, n_steps: int) -> tuple:
    """Post the dK/dV accumulator's transfer after step s: on along the ring with its block, or home after
    the last step. Returns ``(send, receive)`` (None, None when there is no ring)."""
    P, rank = comm.size, comm.rank
    if s + 1 < n_steps:                                           # pass it on with the block
        return comm.isend(acc, (rank + 1) % P, TAG_DKV), comm.irecv(other, (rank - 1) % P, TAG_DKV)
    if n_steps > 1:                                               # last step: the accumulator goes home
        owner, giver = (rank - s) % P, (rank + s) % P
        return comm.isend(acc, owner, TAG_HOME), comm.irecv(other, giver, TAG_HOME)
    return None, None


def ring_attention_backward(grad_out, query, key, value, out, lse, *, is_causal=False, scale=None,
                            enable_gqa=False, layout="zigzag", group=None, mask_mod=None, timeout=None,
                            threads=None, stats=None):
    """Gradients of :func:`ring_attention` for this rank's shards: ``(grad_query, grad_key, grad_value)``.

    Args:
        grad_out: (..., Hq, n, Ev) dLoss/dOutput for this rank's output rows.
        query, key, value: this rank's shards, as given to :func:`ring_attention`.
        out, lse: this rank's output and log-sum-exp from ``ring_attention(..., return_lse=True)``.
        is_causal, scale, enable_gqa, layout, group, mask_mod, timeout, threads, stats: as
            :func:`ring_attention` (``stats`` also counts the dK/dV messages).

    Returns:
        ``(grad_query, grad_key, grad_value)`` with the shapes and dtype of this rank's query, key, value —
        this rank's shard of the single-process gradients (GQA and broadcast dimensions summed as autograd).
        dK and dV of this rank's block are summed along the ring (FlashAttention-2's backward, block by block:
        the accumulator travels with its K/V block and comes home after the last step).
    """
    fn = "ring_attention_backward"
    comm = _Comm(group, timeout, fn)

    def build():
        return _backward_args(fn, grad_out, query, key, value, out, lse, is_causal, scale, enable_gqa, layout,
                              mask_mod, comm.rank, comm.size, threads)
    a, recs = _check(comm, fn, build, extra_shapes=lambda a: (a.grad_out.shape, a.out.shape, a.lse.shape))
    n_steps, cdt, xdt = _ring_dtypes(a, recs)
    n_steps = max(n_steps, 1)
    in_dt = a.query.dtype
    ins = tuple(x.astype(cdt, copy=False) for x in (a.grad_out, a.query, a.out, a.lse))   # do, q, o, lse
    kv, nk = _kv_buffers(a, xdt)
    dkv = [np.zeros(kv[0].size, cdt), np.zeros(kv[0].size, cdt)]  # the accumulator travelling with the block
    dq = np.zeros(a.query.shape, cdt)
    compute_s, wait_s, skipped = [], [], []
    pending_send = pending_recv = None                            # dK/dV of the previous step
    for s in range(n_steps):
        cur, nxt = kv[s % 2], kv[(s + 1) % 2]
        ops = _post_kv(comm, cur, nxt, s, n_steps)
        t0 = time.perf_counter()
        plan = _plan_at(a, s)
        grads = _backward_step(a, ins, cur, nk, plan, threads) if plan else []
        if not plan:
            skipped.append(s)
        compute_s.append(time.perf_counter() - t0)
        w0 = comm.wait_s
        acc = dkv[s % 2]                                          # the accumulator of the held block
        comm.wait(pending_recv)                                   # it arrived from rank r − 1 (s ≥ 1)
        comm.wait(pending_send)                                   # the other buffer is free again
        _accumulate(a, grads, dq, acc, nk)
        pending_send, pending_recv = _post_dkv(comm, acc, dkv[(s + 1) % 2], s, n_steps)
        _wait_all(comm, ops)
        wait_s.append(comm.wait_s - w0)
    mine = dkv[0]
    if n_steps > 1:
        comm.wait(pending_recv)
        comm.wait(pending_send)
        mine = dkv[n_steps % 2]
    _fill_stats(stats, comm, n_steps, compute_s, wait_s, skipped)
    dk, dv = _split_kv(mine, nk, a)
    return (dq.astype(in_dt, copy=False), dk.astype(in_dt, copy=False), dv.astype(in_dt, copy=False))
