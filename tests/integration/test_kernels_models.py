"""The tests of tests/unit/test_kernels.py that need a model package (MiniLM, SmolLM2), its readers,."""
import json
import os

import pytest
from test_kernels import _python  # noqa: E402,F401  (its helpers, shared)


def test_encode_loads_the_kernels_for_long_work_only(tmp_path):
    # encode's GELU uses the kernels once its texts have KERNEL_MIN_TOKENS tokens; a short text never imports numba
    pytest.importorskip("tokenizers")
    code = ("import sys, qkv\n"
            "from qkv.models import load_bert\n"
            "m = load_bert()\n"
            "m.encode(['a short sentence'] * 4)\n"
            "print('numba' in sys.modules)\n"
            "m.encode(['word ' * 200] * 12)\n"
            "print('numba' in sys.modules)\n")
    r = _python(code, QKV_KERNELS="")
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip("MiniLM's package is not installed")
    assert r.stdout.split() == ["False", "True"], r.stderr


def test_kernels_compiled_inside_the_tasks_keep_every_openblas_at_one_thread_there(tmp_path):
    """On an empty numba cache only the first kernel compiles before the tasks (kernels._warm: numba's compiler
    and the OpenBLAS of SciPy's it loads); the others, the compiled loops among them, compile inside the tasks,
    under the engine's BLAS limit — which must still hold every OpenBLAS threadpoolctl sees at one thread there,
    in that call and the next, and give them back after. (MKL is held by its thread-local setting instead:
    tests/unit/test_gemm.py.)"""
    code = ("import json, numpy as np, threadpoolctl\n"
            "from qkv.backends import tiled\n"
            "def openblas():\n"
            "    return sorted((d['filepath'], d['num_threads']) for d in threadpoolctl.threadpool_info()\n"
            "                  if d['internal_api'] == 'openblas')\n"
            "seen, real = [], tiled.forward_pass._forward_task\n"
            "def spy(*a):\n"
            "    seen.append(openblas())\n"
            "    return real(*a)\n"
            "tiled.forward_pass._forward_task = spy\n"
            "q = np.random.default_rng(0).standard_normal((1, 4, 1024, 64)).astype(np.float32)\n"
            "for causal in (False, True, False):\n"
            "    tiled.forward(q, q, q, scale=0.125, is_causal=causal, threads=2)\n"
            "print(json.dumps([seen, openblas()]))\n")
    r = _python(code, NUMBA_CACHE_DIR=str(tmp_path), QKV_KERNELS="", OMP_NUM_THREADS="", OPENBLAS_NUM_THREADS="")
    assert r.returncode == 0, r.stderr
    seen, after = json.loads(r.stdout)
    assert len(seen) == 3 * 4 and all(s and all(n == 1 for _, n in s) for s in seen), seen   # every task: 1
    assert any("scipy_openblas-" in f for f, _ in seen[0])                  # SciPy's, loaded by numba, too
    assert all(n > 1 for _, n in after) or os.cpu_count() == 1, after     # …and back after
    assert any(p.suffix == ".nbi" for p in tmp_path.rglob("*"))            # numba compiled into this cache
