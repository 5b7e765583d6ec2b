"""Start P local processes with torch's own machinery and run a function on each (gloo on 127.0.0.1).

:func:`launch` is what ``qkv ring`` and the tests use: ``torch.multiprocessing.start_processes`` (spawn), one
``init_process_group("gloo", "tcp://127.0.0.1:<free port>")`` per process with a timeout (once every process
has started: a barrier, so slow start-ups do not use the timeout up), the function's return value sent back
through a queue, and every process joined — or killed when the run passes its deadline, a process dies
without a word, or another rank has failed (then the failed rank's own error is the one reported, not the
timeout of the ranks that waited for it). Nothing waits forever.

:func:`run_ring` is ``qkv ring``'s run: each rank builds only its own shard (the sequence is defined chunk by
chunk from ``SeedSequence([seed, chunk])``, so no rank ever holds all of it), runs :func:`ring_attention`
(and its backward), and reports times, messages, bytes and peak memory; with ``check`` the parent computes the
single-process result of the whole sequence and compares.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np

from qkv.integrations.distributed import _layout

#: Seconds a launched run may take in all, by default, before its processes are killed.
DEFAULT_DEADLINE = 600.0


def _free_port() -> int:
    """A free TCP port for the rendezvous (torch's own helper, as torchrun's standalone mode uses)."""
    from torch.distributed.elastic.utils.distributed import get_free_port
    return get_free_port()


def _entry(rank, fn, nproc, port, queue, args, timeout, backend, ready=None, logs=None,
           start_s=DEFAULT_DEADLINE):
    """A launched process: join the group, run ``fn(rank, nproc, *args)``, report, leave.

    ``ready`` (a barrier of all the processes, ``start_s`` at most) holds every rank back until the last one
    has started, so the rendezvous does not spend ``timeout`` on the others' start-up; ``logs[rank]`` (a file,
    when given) takes this process's stderr, torch's C++ log lines included."""
    import datetime
    import threading

    log = None if logs is None else logs[rank]
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(fd, 2)
        os.close(fd)
    import torch.distributed as dist
    ok, res = False, None
    try:
        if backend == "nccl":                                 # one CUDA device per process, round robin
            import torch
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if ready is not None:
            try:
                ready.wait(start_s)
            except threading.BrokenBarrierError:
                raise RuntimeError("another process did not start; this one stopped before the ring") from None
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc,
                                timeout=datetime.timedelta(seconds=timeout))
        res = fn(rank, nproc, *args)
        ok = True
    except BaseException as exc:                              # reported to the parent, one line
        res = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    try:
        queue.put((rank, ok, res))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:                                     # a broken group: nothing left to release
            pass


def _last_line(path) -> str:
    """The last non-empty line of a rank's stderr file ('' when none)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - 4096))
            lines = [x.strip() for x in fh.read().decode("utf-8", "replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return " ".join(lines[-1].split()) if lines else ""


def launch(fn, nproc, args=(), *, timeout=None, deadline=None, backend="gloo", quiet=False):
    """Run ``fn(rank, nproc, *args)`` in ``nproc`` fresh local processes joined in one process group.

    Args:
        fn: a module-level function (it is pickled to the spawned processes); its return value comes back.
        nproc: P ≥ 1.
        args: more arguments for ``fn`` (picklable).
        timeout: the process group's timeout in seconds (default :data:`qkv.distributed.DEFAULT_TIMEOUT`);
            the processes start the rendezvous together (a barrier), so it need not cover their start-up.
        deadline: seconds the whole run may take before every process is killed (default 600).
        backend: ``"gloo"`` (CPU; the default) — ``"nccl"`` needs a CUDA device per process.
        quiet: the processes' stderr (torch's C++ log lines among it) goes to files, not to this process's
            stderr; a process that dies without a result reports the last line of its file.

    Returns:
        ``[fn's result on rank 0, …, on rank P−1]``.

    Raises:
        RuntimeError naming each failed rank, when and its error (the rank whose own error it was first, then
        the ones that timed out waiting for it); once one rank failed, the others get :data:`FAILURE_GRACE`
        seconds to report and are then stopped, rather than waiting out their timeout. TimeoutError past the
        deadline.
    """
    import multiprocessing
    import shutil
    import tempfile

    try:
        import torch.multiprocessing as tmp
    except ImportError:
        raise ImportError("launch needs torch (torch.multiprocessing, torch.distributed): pip install "
                          "'qkv[torch]'") from None

    from qkv.integrations.distributed._ring import DEFAULT_TIMEOUT
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc: expected an integer >= 1, got {nproc!r}")
    timeout = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    deadline = DEFAULT_DEADLINE if deadline is None else float(deadline)
    if not (0 < timeout < math.inf and 0 < deadline < math.inf):
        raise ValueError(f"timeout, deadline: expected positive finite seconds, got {timeout!r}, {deadline!r}")
    mp = multiprocessing.get_context("spawn")
    queue = mp.Queue()
    ready = mp.Barrier(nproc)
    logs_dir = tempfile.mkdtemp(prefix="qkv-launch-") if quiet else None
    logs = None if logs_dir is None else [os.path.join(logs_dir, f"rank{r}.log") for r in range(nproc)]
    try:
        t0 = time.monotonic()
        ctx = tmp.start_processes(_entry, args=(fn, nproc, _free_port(), queue, tuple(args), timeout, backend,
                                                ready, logs, deadline),
                                  nprocs=nproc, join=False, start_method="spawn")
        procs = ctx.processes
        got: dict = {}
        try:
            got = _collect(procs, queue, ready, logs, t0, deadline)
        finally:
            _stop(procs, everyone_reported=len(got) == nproc, end=t0 + deadline)
            queue.close()
    finally:
        if logs_dir is not None:
            shutil.rmtree(logs_dir, ignore_errors=True)
    if any(not ok for ok, _, _ in got.values()) or len(got) < nproc:
        raise RuntimeError(_failure_message(got, nproc))
    return [got[r][1] for r in range(nproc)]


#: Seconds the other ranks get to report once one rank has failed; then the ones still running (most likely
#: waiting in a collective for the failed rank, until their timeout) are stopped.
FAILURE_GRACE = 2.0


def _collect(procs, queue, ready, logs, t0: float, deadline: float) -> dict:
    """``{rank: (ok, result or error line, seconds since the start)}`` as the ranks report; a process gone
    without a report counts as failed. Returns once every rank reported, or :data:`FAILURE_GRACE` seconds after
    the first failure (the ranks still running are then left out); TimeoutError past the deadline."""
    import queue as queue_mod
    nproc, end = len(procs), t0 + deadline
    got: dict = {}
    dead_since: dict = {}
    first_failure = None
    while len(got) < nproc:
        try:
            rank, ok, res = queue.get(timeout=0.1)
            got[rank] = (ok, res, time.monotonic() - t0)
        except queue_mod.Empty:
            pass
        now = time.monotonic()
        for r, p in enumerate(procs):
            if r not in got and not p.is_alive():
                first = dead_since.setdefault(r, now)
                if now - first > 2.0:                      # gone without a report (killed, crashed)
                    last = "" if logs is None else _last_line(logs[r])
                    got[r] = (False, f"the process exited with code {p.exitcode} without a result"
                                     + (f" (its last line on stderr: {last})" if last else ""), now - t0)
                    ready.abort()                          # the others need not wait for it to start
        if first_failure is None and any(not v[0] for v in got.values()):
            first_failure = now
        if first_failure is not None and now - first_failure > FAILURE_GRACE:
            break
        if now > end:
            raise TimeoutError(f"launch: the {nproc} processes did not finish within {deadline:g} s; "
                               "they were stopped")
    return got


def _stop(procs, everyone_reported: bool, end: float) -> None:
    """Join the processes (they leave once they reported) — or kill at once the ones still running."""
    if everyone_reported:
        for p in procs:
            p.join(timeout=max(0.1, min(10.0, end - time.monotonic() + 5.0)))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)


def _failure_message(got: dict, nproc: int) -> str:
    """The failed ranks, the cause first: a rank's own error before the RingErrors of the ranks that waited for
    it, each with when it failed; then the ranks stopped while still running."""
    failed = sorted((r for r in got if not got[r][0]),
                    key=lambda r: (str(got[r][1]).startswith("RingError"), got[r][2], r))
    parts = [f"rank {r} failed after {got[r][2]:.1f} s: {got[r][1]}" for r in failed]
    running = [r for r in range(nproc) if r not in got]
    if running and failed:
        names = ", ".join(str(r) for r in running)
        parts.append(f"rank{'s' if len(running) > 1 else ''} {names} stopped: still running {FAILURE_GRACE:g} s "
                     f"after rank {failed[0]} failed (waiting for it)")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------- qkv ring
def chunk_arrays(cfg: dict, u: int, grad: bool = False):
    """Chunk ``u`` of the sequence (``cfg['N'] / units`` positions): q, k, v (or dO with ``grad``)."""
    P, N = cfg["P"], cfg["N"]
    c = N // _layout.units(P, cfg["layout"])
    dt = np.dtype(cfg["dtype"])
    B, H, Hk, E = cfg["B"], cfg["H"], cfg["Hk"], cfg["E"]
    rng = np.random.default_rng(np.random.SeedSequence([cfg["seed"], 1 + int(grad), u]))
    if grad:
        return (rng.standard_normal((B, H, c, E)).astype(dt),)
    return (rng.standard_normal((B, H, c, E)).astype(dt), rng.standard_normal((B, Hk, c, E)).astype(dt),
            rng.standard_normal((B, Hk, c, E)).astype(dt))


def full_arrays(cfg: dict, grad: bool = False):
    """The whole sequence, chunk by chunk in order (for the single-process check)."""
    k = _layout.units(cfg["P"], cfg["layout"])
    chunks = [chunk_arrays(cfg, u, grad) for u in range(k)]
    return tuple(np.concatenate([ch[i] for ch in chunks], axis=-2) for i in range(len(chunks[0])))


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def _peak_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def ring_worker(rank: int, P: int, cfg: dict) -> dict:
    """One rank of ``qkv ring``: its shard, the ring (forward, and backward when asked), the measurements."""
    import datetime

    import torch.distributed as dist

    from qkv.core import mods
    from qkv.integrations.distributed._ring import ring_attention, ring_attention_backward
    base = _rss_mb()
    parts = [chunk_arrays(cfg, u) for u in _layout.chunk_of(rank, P, cfg["layout"])]
    q, k, v = (np.concatenate([p[i] for p in parts], axis=-2) for i in range(3))
    del parts
    kw = dict(is_causal=cfg["causal"], enable_gqa=cfg["Hk"] != cfg["H"], layout=cfg["layout"],
              timeout=cfg["timeout"], threads=cfg["threads"],
              mask_mod=None if not cfg.get("window") else mods.sliding_window(cfg["window"]))
    td = datetime.timedelta(seconds=cfg["timeout"])
    reps = cfg.get("repeats", 1)

    def timed(fn):
        """``fn()`` ``repeats`` times, all ranks starting together: (last result, median wall s, median CPU s)."""
        walls, cpus, got = [], [], None
        for _ in range(reps):
            dist.barrier(async_op=True).wait(td)
            t0, c0 = time.perf_counter(), time.process_time()
            got = fn()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        return got, float(np.median(walls)), float(np.median(cpus))
    st: dict = {}
    (out, lse), wall, cpu = timed(lambda: ring_attention(q, k, v, return_lse=True, stats=st, **kw))
    res = {"rank": rank, "forward_s": wall, "forward_cpu_s": cpu, "forward": st, "base_mb": base}
    if cfg["backward"]:
        (do,) = (np.concatenate([chunk_arrays(cfg, u, grad=True)[0] for u in _layout.chunk_of(rank, P, cfg["layout"])],
                                axis=-2),)
        sb: dict = {}
        grads, wall, cpu = timed(lambda: ring_attention_backward(do, q, k, v, out, lse, stats=sb, **kw))
        res.update(backward_s=wall, backward_cpu_s=cpu, backward=sb)
        if cfg["check"]:
            res["grads"] = grads
    res["peak_mb"] = _peak_mb()
    res["shard_mb"] = (q.nbytes + k.nbytes + v.nbytes) / 2**20
    if cfg["check"]:
        res["out"], res["lse"] = out, lse
    return res


def run_ring(*, nproc: int, length: int, heads: int = 8, kv_heads: int | None = None, dim: int = 64, batch: int = 1,
             causal: bool = False, layout: str = "zigzag", window: int | None = None, dtype: str = "float32",
             backward: bool = False, check: bool = False, seed: int = 0, timeout: float | None = None,
             threads: int | None = None, deadline: float | None = None, repeats: int = 1,
             quiet: bool = False) -> dict:
    """``qkv ring``: run the ring on ``nproc`` local processes and (``check``) against one process (``quiet``:
    the processes' stderr, torch's C++ log lines among it, does not reach this one's; see :func:`launch`).

    Returns a dict: the configuration, per-rank results (times, stats, peak RSS), and with ``check`` the
    single-process times and the largest differences (output, lse, and gradients with ``backward``). Times
    are medians of ``repeats`` runs (wall and CPU seconds; the ranks start each run together)."""
    from qkv import _checks
    from qkv.integrations.distributed._ring import DEFAULT_TIMEOUT
    P = _checks.positive_int(nproc, "nproc")
    N = _checks.positive_int(length, "length")
    layout = _layout.check_layout(layout)
    err = _layout.length_error(N, P, layout)
    if err:
        raise ValueError(f"--length: {err}")
    Hk = heads if kv_heads is None else kv_heads
    if heads % Hk:
        raise ValueError(f"--kv-heads: must divide --heads ({heads}), got {Hk}")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // P)
    cfg = dict(P=P, N=N, H=heads, Hk=Hk, E=dim, B=batch, causal=bool(causal), layout=layout, window=window,
               dtype=dtype, backward=bool(backward), check=bool(check), seed=seed, threads=threads,
               repeats=_checks.positive_int(repeats, "repeats"),
               timeout=DEFAULT_TIMEOUT if timeout is None else float(timeout))
    t0 = time.perf_counter()
    ranks = launch(ring_worker, P, (cfg,), timeout=cfg["timeout"], deadline=deadline, quiet=quiet)
    result = {"config": cfg, "ranks": ranks, "launch_s": time.perf_counter() - t0}
    if check:
        result["check"] = _check_single(cfg, ranks)
    return result


def _check_single(cfg: dict, ranks: list) -> dict:
    """The single-process forward (and backward) of the whole sequence, timed, and the ring's differences."""
    from qkv.core import mods
    from qkv.engine.backends import tiled
    from qkv.engine.api import get_num_threads
    from qkv.integrations.distributed._layout import unshard
    q, k, v = full_arrays(cfg)
    scale = 1.0 / math.sqrt(cfg["E"])
    gqa = cfg["Hk"] != cfg["H"]
    bm = None
    if cfg.get("window"):
        from qkv.core.blockmask import create_block_mask
        bm = create_block_mask(mods.sliding_window(cfg["window"]), None, None, cfg["N"], cfg["N"])
    kw = dict(is_causal=cfg["causal"], scale=scale, enable_gqa=gqa, block_mask=bm)
    reps = cfg.get("repeats", 1)

    def timed(fn):
        walls, cpus, got = [], [], None
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.process_time()
            got = fn()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        return got, float(np.median(walls)), float(np.median(cpus))
    (out, _, lse), single_fwd, single_fwd_cpu = timed(lambda: tiled.forward(q, k, v, return_lse=True, **kw))
    lay = cfg["layout"]
    ring_out = unshard([r["out"] for r in ranks], layout=lay)
    ring_lse = unshard([r["lse"] for r in ranks], layout=lay, seq_dim=-1)
    res = {"threads": get_num_threads(), "forward_s": single_fwd, "forward_cpu_s": single_fwd_cpu,
           "out": _diff(ring_out, out),
           "lse": _diff(ring_lse, lse)}
    if cfg["backward"]:
        (do,) = full_arrays(cfg, grad=True)
        g, res["backward_s"], res["backward_cpu_s"] = timed(         # as the ring: given O and lse
            lambda: tiled.backward(do, q, k, v, out=out, lse=lse, **kw))
        for i, name in enumerate(("dq", "dk", "dv")):
            ring_g = unshard([r["grads"][i] for r in ranks], layout=lay)
            res[name] = _diff(ring_g, g[i])
    tol = 1e-12 if cfg["dtype"] == "float64" else 1e-5
    res["tolerance"] = tol
    res["ok"] = all(res[n]["relative"] <= tol for n in ("out", "lse", "dq", "dk", "dv") if n in res)
    return res


def _diff(got, want) -> dict:
    """The largest absolute difference, and relative to max(1, the largest |want|) (−inf equal to −inf)."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    same = (g == w)                                          # −inf rows of the lse
    d = np.where(same, 0.0, np.abs(g - w))
    big = float(np.max(np.abs(np.where(np.isfinite(w), w, 0.0)), initial=0.0))
    worst = float(np.max(d, initial=0.0))
    return {"max_abs": worst, "relative": worst / max(1.0, big)}
