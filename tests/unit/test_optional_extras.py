"""qkv.models, qkv.lab and qkv.distributed load on first attribute access, as qkv.viz does, and every optional
dependency that is missing is one ImportError naming its extra (issue 26). Each case runs in its own Python with
the module made unimportable (``sys.modules[name] = None``)."""
import subprocess
import sys

import pytest

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow

LAZY = """
import sys, qkv
assert not {"qkv.models", "qkv.lab", "qkv.distributed", "qkv.viz"} & set(sys.modules), "imported eagerly"
print(qkv.models.load_bert.__name__, qkv.lab.scale.__name__, qkv.distributed.shard.__name__, qkv.viz.heatmap.__name__)
assert {"models", "lab", "distributed", "viz"} <= set(dir(qkv))
try:
    qkv.nosuch
except AttributeError as e:
    print(e)
"""


def run(code: str, missing: str | None = None):
    pre = f"import sys; sys.modules[{missing!r}] = None\n" if missing else ""
    return subprocess.run([sys.executable, "-c", pre + code], capture_output=True, text=True, timeout=120)


def test_subpackages_load_on_first_attribute_access():
    p = run(LAZY)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["load_bert run shard heatmap", "module 'qkv' has no attribute 'nosuch'"]


CASES = [
    ("torch", "import qkv; qkv.distributed.launch(print, 2)", "launch needs torch", "torch"),
    ("torch", "import numpy as np, qkv; x = np.zeros((1, 4, 2)); qkv.distributed.ring_attention(x, x, x)",
     "ring_attention: needs torch", "torch"),
    ("torch", "from qkv.distributed._launch import run_ring; run_ring(nproc=2, length=16)", "launch needs torch",
     "torch"),
    ("safetensors", "import qkv; qkv.models.load_bert()", "load_bert needs safetensors", "model"),
    ("gguf", "import qkv; qkv.models.load_llama()", "load_llama needs gguf", "llama"),
    ("matplotlib", "import numpy as np, qkv; qkv.viz.heatmap(np.eye(3))", "need matplotlib", "viz"),
    ("matplotlib", "import qkv, qkv.viz; qkv.viz.plot_lab('scale', qkv.lab.scale(samples=16), 'x.png')",
     "qkv.viz.plot_lab needs matplotlib", "viz"),
    ("matplotlib", "import qkv.bench; qkv.bench.plot({}, 'x.png')", "qkv.bench.plot needs matplotlib", "viz"),
    ("networkx", "import numpy as np, qkv; qkv.viz.attention_flow([np.full((1, 3, 3), 1 / 3)])",
     "attention_flow needs networkx", "viz"),
]


@pytest.mark.parametrize("missing, code, words, extra", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_missing_dependency_names_its_extra(tmp_path, missing, code, words, extra):
    p = subprocess.run([sys.executable, "-c", f"import sys; sys.modules[{missing!r}] = None\n" + code],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and last.startswith("ImportError: "), p.stderr
    assert words in last and f"pip install 'qkv[{extra}]'" in last, last
    assert "ModuleNotFoundError" not in p.stderr and list(tmp_path.iterdir()) == []
