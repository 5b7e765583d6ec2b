"""The tiled engine's runtime: its resources — worker pools, BLAS's thread limit, the GEMM providers and block
kernels once loaded, and every cache — kept in one object (:data:`RUNTIME`) apart from the numerics in
:mod:`qkv.backends.tiled`. What the engine is *asked* to use (GEMM provider, kernels, worker threads, limits) is
the configuration's (:func:`qkv.config`, one context variable over a process default: :mod:`qkv._settings`);
the runtime's ``set_*`` methods are thin writers of that default.

What it holds, and why each part is shaped as it is:

* **Pools, one per worker count, never shut down.** Callers on several Python threads may ask for different
  ``threads=`` at the same time; a single pool resized on demand was shut down under callers still
  submitting to it (``RuntimeError: cannot schedule new futures after shutdown``). A pool of ``n`` workers
  is made on first use and kept; idle workers cost a blocked thread each. Workers of a pool with at most one
  worker per CPU are pinned, one per CPU (:attr:`Runtime.PIN_WORKERS`).
* **BLAS limited to one thread, counted.** While workers run, each matmul must stay on its worker's core, so
  BLAS is held to one thread (``threadpoolctl``, from the ``fast`` extra; without it a no-op). The setting is
  process-wide, so the limit is reference-counted: the first caller entering sets it, the last caller
  leaving restores what was there before the first entered. (Each call restoring what it saw on entry left
  OpenBLAS at 1 thread for good after two overlapping calls.)
* **Fork.** A forked child has none of the parent's threads: it drops the pools (new ones start on first
  use) and, if parent callers held BLAS at one thread when it forked, gives the child its original setting.
* **The GEMM providers** (:mod:`qkv.gemm`): :attr:`Runtime.gemm`, NumPy's BLAS and Intel MKL once loaded, and
  ``auto``'s calibration (the choice: ``qkv.config(gemm=...)``, ``set_gemm``/``get_gemm``). MKL has a per-thread setting, so each worker holds
  it to one thread for good and a caller running tasks inline holds it for the call
  (:class:`qkv.gemm.single_threaded`); NumPy's BLAS has only the process-wide limit above.
* **The block kernels** (:mod:`qkv.kernels`): :attr:`Runtime.kernels`, numba's compiled block passes once
  loaded (the choice: ``qkv.config(kernels=...)``, ``set_kernels``/``get_kernels``); the engine asks it for each
  call and block.
* **Caches, thread-safe and bounded.** :attr:`Runtime.patterns` keeps the block patterns that recur call after
  call (the causal triangle per offset, ALiBi's bias per slope, a mask mod's partial cells), within a byte
  budget; :meth:`Runtime.plans` keeps what the engine derived from a block mask (its cell grids and block
  plans) for as long as the block mask lives; :attr:`Runtime.memo` what small functions derive from a few
  numbers (softcap's polynomial per bound, the row shares per shape), at most :attr:`Runtime.MEMO_ITEMS`
  entries; :attr:`Runtime.base2_guess` the last task's base-2 choice (the next task's first guess). Worker
  threads fill them all: each has a lock.
* **Contexts.** Each task runs in a copy of its caller's context (:mod:`contextvars`), so that a worker sees
  the configuration its task was started with (``qkv.config``, ``tiled.limits``), not its own thread's.
* **Nested calls.** A call from inside a worker runs inline: a worker waiting on its own pool could wait
  forever.

:meth:`Runtime.run` runs the tiled engine's tasks; :meth:`Runtime.map` runs other parallel work (the
batches of :meth:`qkv.models.BertModel.encode`) on the same workers under the same BLAS limit, so the process
has one pool per size and one owner of the BLAS setting.
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np

from qkv import _checks, _settings
from qkv.compute import gemm as _gemm, kernels as _kernels

__all__ = ["RUNTIME", "BoundedCache", "Memo", "PlanCache", "Runtime", "default_num_threads", "get_gemm", "get_kernels", "get_num_threads", "set_gemm", "set_kernels", "set_num_threads"]


def default_num_threads() -> int:
    """The cores this process may run on (``os.sched_getaffinity``), else ``os.cpu_count()``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _from_any_thread(set_blas):
    """Run ``set_blas()`` (a threadpoolctl limit or restore) so that it takes effect whichever thread runs it.

    threadpoolctl (3.8 on) lets only one Python thread, the first to set it, change the thread count of an
    OpenBLAS built with pthreads, and silently ignores the others. The runtime sets it from whichever caller
    enters first and restores it from whichever leaves last, so it drops that claim before and after (under
    the runtime's BLAS lock). Measured here: while the main thread held the claim (inside a
    ``threadpool_limits`` block), the limit set from a caller on another thread was ignored and BLAS stayed
    at 2 threads inside the call; a restore ignored that way would leave it at 1.
    """
    import threadpoolctl

    release = getattr(getattr(threadpoolctl, "OpenBLASController", None), "clear_controlling_thread", None)
    if release is None:                                  # threadpoolctl < 3.8: any thread may set it
        return set_blas()
    release(force=True)
    try:
        return set_blas()
    finally:
        release(force=True)


class BoundedCache:
    """Values (tuples holding arrays) built once per key, kept while their arrays fit ``budget`` bytes (past
    it the cache starts again empty). Thread-safe: a value is built outside the lock (two threads may build
    the same one; the first stored wins)."""

    def __init__(self, budget: int):
        self.budget = budget
        self._lock = threading.Lock()
        self._items: dict = {}
        self._bytes = 0

    def get(self, key, build):
        """The value under ``key``, made by ``build()`` the first time."""
        got = self._items.get(key)
        if got is not None:
            return got
        value = build()
        size = sum(x.nbytes for x in value if hasattr(x, "nbytes"))
        with self._lock:
            got = self._items.get(key)
            if got is not None:
                return got
            if self._bytes + size > self.budget:
                self._items.clear()
                self._bytes = 0
            self._items[key] = value
            self._bytes += size
        return value

    def drop(self, key) -> None:
        with self._lock:
            value = self._items.pop(key, None)
            if value is not None:
                self._bytes -= sum(x.nbytes for x in value if hasattr(x, "nbytes"))

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)


class Memo:
    """Small values computed from a few numbers, kept per key: at most ``items`` of them (past that the memo
    starts again empty). Thread-safe: a value is computed outside the lock (two threads may compute the same
    one; the first stored wins)."""

    def __init__(self, items: int):
        self.items = items
        self._lock = threading.Lock()
        self._values: dict = {}

    def get(self, key, compute):
        """The value under ``key``, made by ``compute()`` the first time."""
        try:
            return self._values[key]
        except KeyError:
            pass
        value = compute()
        with self._lock:
            if key not in self._values:
                if len(self._values) >= self.items:
                    self._values.clear()
                self._values[key] = value
            return self._values[key]

    def clear(self) -> None:
        with self._lock:
            self._values.clear()

    def __len__(self) -> int:
        return len(self._values)


class Hint:
    """One value that tasks on any thread write and read (a guess: whichever write came last is as good),
    written under a lock."""

    def __init__(self, value=None):
        self._lock = threading.Lock()
        self._value = value

    def get(self):
        return self._value

    def set(self, value) -> None:
        with self._lock:
            self._value = value


class Runtime:
    """Worker pools, the counted BLAS limit, the loaded GEMM providers and kernels, and the caches of the
    tiled engine — resources only (the settings are :func:`qkv.config`'s).

    Safe to call from any number of Python threads at once, with any mix of thread counts.
    """

    #: Pin each worker of a pool to its own CPU (Linux; when the pool has at most one worker per CPU).
    #: Left to the scheduler, both workers were measured sharing one core after a library with its own
    #: thread pool (torch's OpenMP) had run: 6.8 ms instead of 4.1 ms for N = 512, H = 8, until the load
    #: balancer noticed. Set to False (before the pool is made) to leave placement to the OS.
    PIN_WORKERS = True
    #: Names of the worker threads start with this.
    WORKER_PREFIX = "qkv-tiled"
    #: The byte budget of :attr:`patterns`.
    PATTERN_BYTES = 64 << 20
    #: The entries :attr:`memo` keeps at most.
    MEMO_ITEMS = 1024

    def __init__(self):
        #: The GEMM providers (one per process, :data:`qkv.gemm.GEMM`): every matmul of the engine asks them.
        self.gemm = _gemm.GEMM
        #: The block kernels (one per process, :data:`qkv.kernels.KERNELS`): numba's or NumPy's passes.
        self.kernels = _kernels.KERNELS
        #: Block patterns that recur call after call (64 MiB at most).
        self.patterns = BoundedCache(self.PATTERN_BYTES)
        #: Small values derived from a few numbers, by key (``("tanh_poly", Y)``, ``("shares", L, S, …)``).
        self.memo = Memo(self.MEMO_ITEMS)
        #: Whether the last task planned, in any call, took base 2 (the next one's first guess; None: none yet).
        self.base2_guess = Hint()
        self._scratch = threading.local()               # each thread's scratch blocks, by name
        self._plans: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._plans_lock = threading.Lock()
        self._reset()
        if hasattr(os, "register_at_fork"):
            ref = weakref.ref(self)                     # the hooks must not keep a Runtime alive
            os.register_at_fork(before=lambda: (r := ref()) is not None and r._blas_lock.acquire(),
                                after_in_parent=lambda: (r := ref()) is not None and r._blas_lock.release(),
                                after_in_child=lambda: (r := ref()) is not None and r._after_fork_in_child())

    def _reset(self) -> None:
        self._lock = threading.Lock()                   # guards _pools
        self._pools: dict[int, ThreadPoolExecutor] = {}
        self._local = threading.local()                 # .worker: this thread is one of our workers
        self._blas_lock = threading.Lock()              # guards the three below
        self._controller = None                         # threadpoolctl.ThreadpoolController, made once (slow)
        self._blas_users = 0                            # callers inside blas_single_threaded()
        self._blas_limiter = None                       # holds the setting to restore when the count is 0
        self._rescan = False                            # rescan the libraries when the count is next 0

    def _after_fork_in_child(self) -> None:
        """The child has only the forking thread: no worker, no caller inside the BLAS limit.

        The BLAS lock was taken before the fork (and is released in the parent), so no thread of the runtime
        was inside threadpoolctl, holding its locks, when the child was made.
        """
        limiter = self._blas_limiter if self._blas_users else None
        self._reset()
        if limiter is not None:                         # forked while parent callers held BLAS at 1
            with contextlib.suppress(Exception):
                _from_any_thread(limiter.restore_original_limits)

    # ------------------------------------------------------------------------------------------ threads
    default_num_threads = staticmethod(default_num_threads)

    def set_num_threads(self, n: int | None) -> None:
        """Set the worker threads of the tiled engine — the process default of :func:`qkv.config`'s ``threads``;
        ``None`` restores the default (the available cores)."""
        if n is not None:
            n = _checks.positive_int(n, "n")
        _settings.set_default(threads=n)

    def get_num_threads(self) -> int:
        """The worker threads the tiled engine uses here (:func:`qkv.config`'s ``threads``, else the cores)."""
        return _settings.current().threads or default_num_threads()

    @property
    def threads(self) -> int | None:
        """The process default's worker count (None: not set); assigning it is :meth:`set_num_threads`."""
        return _settings.process_default().threads

    @threads.setter
    def threads(self, n: int | None) -> None:
        self.set_num_threads(n)

    def resolve_threads(self, threads) -> int:
        """A call's ``threads=`` argument: None means :meth:`get_num_threads`; else a positive int."""
        if threads is None:
            return self.get_num_threads()
        return _checks.positive_int(threads, "threads")

    # ------------------------------------------------------------------------------------------ GEMM
    def set_gemm(self, name: str = "auto") -> None:
        """Choose the engine's GEMM provider: ``"auto"``, ``"numpy"`` or ``"mkl"`` (see :mod:`qkv.gemm`)."""
        self.gemm.set(name)

    def get_gemm(self) -> str:
        """The GEMM provider in use, ``"numpy"`` or ``"mkl"`` (``auto`` resolved)."""
        return self.gemm.get()

    # ------------------------------------------------------------------------------------------ kernels
    def set_kernels(self, name: str = "auto") -> None:
        """Choose the engine's block kernels: ``"auto"``, ``"numpy"`` or ``"numba"`` (see :mod:`qkv.kernels`)."""
        self.kernels.set(name)

    def get_kernels(self) -> str:
        """The block kernels in use, ``"numba"`` or ``"numpy"``."""
        return self.kernels.get()

    # ------------------------------------------------------------------------------------------ caches
    def plans(self, block_mask) -> "PlanCache":
        """The cache of what the engine derived from ``block_mask`` (cell grids, block plans), kept as long as
        the block mask lives (a block mask is built once and reused call after call; so are its plans)."""
        with self._plans_lock:
            got = self._plans.get(block_mask)
            if got is None:
                got = self._plans[block_mask] = PlanCache()
            return got

    def scratch(self, rows: int, cols: int, dtype, name: str = "scores"):
        """A (rows, cols) block of the calling thread's scratch memory, reused by each worker thread from task to
        task and call to call (a few MB per thread; one buffer per name, as large as the largest block asked for:
        the limits' block sizes bound it): a fresh multi-megabyte temporary per block costs its page faults every
        time (measured: a third of the backward's time at N = 512). Per thread, so no lock."""
        buf = getattr(self._scratch, name, None)
        if buf is None or buf.size < rows * cols or buf.dtype != dtype:
            buf = np.empty(rows * cols, dtype)
            setattr(self._scratch, name, buf)
        return buf[:rows * cols].reshape(rows, cols)

    # ------------------------------------------------------------------------------------------ pools
    def pool(self, n: int) -> ThreadPoolExecutor:
        """The pool of ``n`` workers, made on first use and kept for the life of the process (or until a
        fork: the child makes its own)."""
        with self._lock:
            pool = self._pools.get(n)
            if pool is None:
                cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
                pin = self.PIN_WORKERS and hasattr(os, "sched_setaffinity") and 1 < n <= len(cpus)
                pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix=f"{self.WORKER_PREFIX}-{n}",
                                          initializer=self._start_worker,
                                          initargs=(cpus if pin else None, itertools.count(), threading.Lock()))
                self._pools[n] = pool
            return pool

    def _start_worker(self, cpus, counter, lock) -> None:
        """Pool initializer: mark the thread as a worker (its matmuls on one thread: MKL's thread-local
        setting; its numba kernels too: :func:`qkv.compute.kernels.hold_one_thread`); worker i runs on CPU i of
        ``cpus`` (if given)."""
        self._local.worker = True
        _gemm.hold_single_threaded_for_good()
        _kernels.hold_one_thread()
        if cpus:
            with lock:
                i = next(counter)
            try:
                os.sched_setaffinity(0, {cpus[i % len(cpus)]})      # 0: the calling thread, on Linux
            except OSError:  # pragma: no cover - CPU set changed under us
                pass

    def in_worker(self) -> bool:
        """Whether the calling thread is one of this runtime's workers (its calls then run inline)."""
        return getattr(self._local, "worker", False)

    # ------------------------------------------------------------------------------------------ BLAS
    def _blas_controller(self):
        """The threadpoolctl controller of NumPy's BLAS (made once: it scans the loaded libraries), None
        without threadpoolctl. MKL loaded as the GEMM provider is left out: its threads are set per thread
        (:mod:`qkv.gemm`), and its process-wide setting is per OpenMP thread, so a limit set by one caller
        and restored by another would leave it changed on the first."""
        if self._controller is None:
            try:
                import threadpoolctl
            except ImportError:
                return None
            controller = threadpoolctl.ThreadpoolController()
            mkl = self.gemm._mkl
            if mkl:
                keep = [c.filepath for c in controller.lib_controllers
                        if os.path.realpath(c.filepath) != os.path.realpath(mkl.path)]
                controller = controller.select(filepath=keep)
            self._controller = controller
        return self._controller

    def rescan_blas(self) -> None:
        """Libraries were loaded (numba brings SciPy and its own OpenBLAS): the next caller to set the BLAS
        limit with no other inside scans the loaded libraries again, so that the limit covers them too."""
        with self._blas_lock:
            self._rescan = True

    @contextlib.contextmanager
    def blas_single_threaded(self):
        """BLAS on one thread inside, counted across callers: the first caller entering sets the limit, the
        last leaving restores the setting from before. A no-op without threadpoolctl."""
        with self._blas_lock:
            if self._blas_users == 0:
                if self._rescan:                            # libraries loaded since the scan: scan again
                    self._controller, self._rescan = None, False
                controller = self._blas_controller()
                if controller is not None:
                    self._blas_limiter = _from_any_thread(lambda: controller.limit(limits=1, user_api="blas"))
            self._blas_users += 1
        try:
            yield
        finally:
            with self._blas_lock:
                self._blas_users -= 1
                if self._blas_users == 0 and self._blas_limiter is not None:
                    _from_any_thread(self._blas_limiter.restore_original_limits)
                    self._blas_limiter = None

    def blas_threads(self) -> int | None:
        """BLAS's own thread count — the one set outside the runtime, even while callers hold it at 1 —
        or None without threadpoolctl (or without a BLAS it knows)."""
        with self._blas_lock:
            controller = self._blas_controller()
            if controller is None:
                return None
            if self._blas_users and self._blas_limiter is not None:
                return self._blas_limiter.get_original_num_threads().get("blas")
            return max((int(i.get("num_threads") or 1) for i in controller.info() if i.get("user_api") == "blas"),
                       default=None)

    # ------------------------------------------------------------------------------------------ running
    def run(self, tasks, fn, threads: int) -> None:
        """Run ``fn(*task)`` for every task on ``threads`` workers, BLAS single-threaded inside, each in a copy
        of the caller's context (the configuration it was started with).

        Inline, on the calling thread, when ``threads == 1``, there is one task, or the caller is itself a
        worker. Returns when every task has finished, also when one raised (its exception is re-raised):
        tasks write into the caller's arrays.
        """
        with self.blas_single_threaded(), _gemm.single_threaded():
            if threads == 1 or len(tasks) <= 1 or self.in_worker():
                for t in tasks:
                    fn(*t)
                return
            pool = self.pool(threads)
            futures = [pool.submit(contextvars.copy_context().run, fn, *t) for t in tasks]
            try:
                for f in futures:
                    f.result()
            finally:
                for f in futures:
                    f.cancel()
                wait(futures)

    def map(self, fn, items, threads: int):
        """``fn(item)`` for every item on ``threads`` workers, BLAS single-threaded inside; an iterator of the
        results in the order of ``items``, each as soon as it and those before it are done.

        Inline (still BLAS single-threaded) when ``threads == 1``, there is one item, or the caller is a
        worker. Close the iterator (``contextlib.closing``) if you may stop before its end: the BLAS limit
        lasts until then. Each item runs in a copy of the caller's context (:mod:`contextvars`), so that what
        the caller set there — the tiled engine's limits (:func:`qkv.backends.tiled.limits`) — holds in the
        workers too.
        """
        items = list(items)
        with self.blas_single_threaded(), _gemm.single_threaded():
            if threads == 1 or len(items) <= 1 or self.in_worker():
                for x in items:
                    yield fn(x)
                return
            pool = self.pool(threads)
            futures = [pool.submit(contextvars.copy_context().run, fn, x) for x in items]
            try:
                for f in futures:
                    yield f.result()
            finally:
                for f in futures:
                    f.cancel()
                wait(futures)


class PlanCache(dict):
    """One block mask's plans: a dict whose stores are serialized (worker threads plan blocks at once), kept
    while the block mask lives and at most :attr:`MAX_ITEMS` of them (past that it starts again empty: a block
    mask reused with ever new shapes or limits does not grow without end)."""

    #: Far above one call's tasks (a call plans each of its tasks once; 8 × 32 heads of 8 tasks is 2,048).
    MAX_ITEMS = 1 << 16

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()

    def __setitem__(self, key, value) -> None:
        with self._lock:
            if len(self) >= self.MAX_ITEMS and key not in self:
                self.clear()
            super().__setitem__(key, value)


#: The process's one runtime: the tiled engine and :meth:`qkv.models.BertModel.encode` share it.
RUNTIME = Runtime()
_kernels.KERNELS.on_load.append(RUNTIME.rescan_blas)   # numba brings SciPy's OpenBLAS: limit it too
_gemm.use_blas_limit(RUNTIME.blas_single_threaded)    # auto's calibration times NumPy's BLAS on one thread

set_num_threads = RUNTIME.set_num_threads
get_num_threads = RUNTIME.get_num_threads
set_gemm = RUNTIME.set_gemm
get_gemm = RUNTIME.get_gemm
set_kernels = RUNTIME.set_kernels
get_kernels = RUNTIME.get_kernels
