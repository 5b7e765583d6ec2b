"""qkv.backends.select (issue 42): the one place a backend is chosen, forward and backward, with its reason —
which qkv.plan prints and a trace keeps; a backend registered by a user takes part in ``auto``."""
import ast
import pathlib

import numpy as np
import pytest

import qkv
from qkv import backends
from qkv.backends import Backend, Problem, Request, select, tiled


def _arrays(lead, L, S, E=8):
    r = np.random.default_rng(0)
    return (r.standard_normal(lead + (L, E)).astype(np.float32),
            r.standard_normal(lead + (S, E)).astype(np.float32), r.standard_normal(lead + (S, E)).astype(np.float32))


class Tiny(Backend):
    """A backend that prefers one query length (L = 5) and computes a constant: easy to tell apart."""

    name = "tiny"
    features = frozenset({"mask", "causal", "backward"})

    def preference(self, query, key, value, *, enable_gqa=False, backward=False):
        return query.shape[-2] == 5, "tiny takes L = 5"

    def forward(self, query, key, value, **kw):
        return np.full(query.shape[:-1] + value.shape[-1:], 3.0, query.dtype), None, None

    def backward(self, grad_out, query, key, value, **kw):
        return np.full(query.shape, 4.0), np.zeros(key.shape), np.zeros(value.shape)


@pytest.fixture
def tiny(monkeypatch):
    """Tiny registered with qkv.backends.register (after the built-ins), taken out again afterwards."""
    backends.names()                                      # the built-ins registered first
    from qkv.backends import registry
    monkeypatch.setattr(registry, "BACKENDS", dict(registry.BACKENDS))
    monkeypatch.setattr(backends, "BACKENDS", registry.BACKENDS)
    backends.register("tiny", Tiny())
    return registry.BACKENDS["tiny"]


def test_a_registered_backend_takes_part_in_auto_forward_backward_and_plan(tiny):
    q, k, v = _arrays((1, 2), 5, 16)
    b, reason = select(Request(), Problem(q, k, v))
    assert b is tiny and reason == "auto: tiny takes L = 5"
    assert np.all(qkv.scaled_dot_product_attention(q, k, v) == 3.0)
    assert np.all(qkv.flex_attention(q, k, v) == 3.0)
    assert np.all(qkv.flex_attention_backward(np.ones_like(q), q, k, v)[0] == 4.0)
    p = qkv.plan(q, k, v)
    assert (p.backend, p.reason) == ("tiny", "auto: tiny takes L = 5")
    assert "backend tiny (auto: tiny takes L = 5)" in str(p)
    # L = 6: it declines, the reference takes it, and the reason says why each declined
    q6 = np.concatenate([q, q[..., :1, :]], axis=-2)
    b, reason = select(Request(), Problem(q6, k, v))
    assert b is backends.get("reference")
    assert "below the tiled engine's size rule" in reason and "tiny takes L = 5" in reason
    # a request it does not support goes on down the list, with the backend's own sentence
    b, reason = select(Request(return_weights=True), Problem(q, k, v))
    assert b is backends.get("reference") and "the 'tiny' backend does not compute weights" in reason


def test_the_backward_size_rule_is_a_limit_field():
    q, k, v = _arrays((1, 2), 8, 8)                                   # 2·8·8 = 128 scores
    ask = Request(backward=True)
    with tiled.limits(backward_whole_scores=128):
        b, reason = select(ask, Problem(q, k, v))
        assert b is backends.get("reference") and "128 scores (tiled above 128" in reason
    with tiled.limits(backward_whole_scores=127):
        b, reason = select(ask, Problem(q, k, v))
        assert b is backends.get("tiled") and reason.startswith("auto: large enough for the tiled engine")
    assert tiled.Limits().backward_whole_scores == 1 << 18 == qkv.engine.BACKWARD_WHOLE_SCORES
    used = []
    spy = backends.get("tiled").backward
    with tiled.limits(backward_whole_scores=0), pytest.MonkeyPatch.context() as m:
        m.setattr(backends.get("tiled"), "backward", lambda *a, **kw: (used.append(1), spy(*a, **kw))[1])
        qkv.scaled_dot_product_attention_backward(np.ones_like(q), q, k, v)
        qkv.flex_attention_backward(np.ones_like(q), q, k, v)
    assert used == [1, 1]                                             # both backwards ask the same rule


def test_named_traced_and_torch_requests():
    q, k, v = _arrays((1, 1), 4, 4)
    b, reason = select(Request("tiled"))
    assert b is backends.get("tiled") and reason == "named: backend='tiled'"
    assert select(Request(traced=True))[1] == "traced: only the reference backend records the stages"
    with pytest.raises(ValueError, match="backend: only 'reference' records a trace, got backend='tiled'"):
        select(Request("tiled", traced=True))
    with pytest.raises(ValueError, match=r"backend: the 'torch' backend does not compute backward; use "
                                         r"backend='reference' or None \(auto\)"):
        select(Request("torch", backward=True))
    with pytest.raises(ValueError, match="backend: expected one of"):
        select(Request("nope"))
    with pytest.raises(ValueError, match="backend: torch tensors run on the 'torch' backend, got 'tiled'"):
        select(Request("tiled", torch_tensors=True))
    assert select(Request(torch_tensors=True))[1] == "torch tensors: they run on torch's SDPA"
    with pytest.raises(TypeError, match="problem: expected a Problem"):
        select(Request())


def test_a_trace_keeps_the_backend_and_its_reason():
    q, k, v = _arrays((1, 1), 4, 4)
    with qkv.trace() as t:
        qkv.scaled_dot_product_attention(q, k, v)
    assert t.backends == [("reference", "traced: only the reference backend records the stages")]
    assert t.names()[:3] == ["Q", "K", "V"]                           # no step added for it


def test_accuracy_configured_moves_the_limits_not_a_module_constant():
    import dataclasses
    from qkv import accuracy, engine
    spec = accuracy.draw_spec(lambda name, options: options[0])
    spec = dataclasses.replace(spec, limits=(("auto_tiled_min_scores", 0),))
    with accuracy.configured(spec):
        assert tiled.current_limits().backward_whole_scores == 0
        assert engine.BACKWARD_WHOLE_SCORES == 1 << 18
    assert tiled.current_limits().backward_whole_scores == 1 << 18


def test_no_entry_point_picks_a_backend_by_itself():
    """Outside qkv.backends, nothing names the tiled or reference backend to run it on its own rule: a
    comparison of scores against a threshold, or ``backends.get("tiled"|"reference")``, is select's alone
    (the benchmarks and the accuracy oracle name the backend they measure)."""
    src = pathlib.Path(qkv.__file__).parent
    allowed = {"tools/bench/_variants.py", "tools/accuracy.py"}
    found = []
    for path in src.rglob("*.py"):
        rel = path.relative_to(src).as_posix()
        if rel.startswith("engine/backends/") or rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and ast.unparse(node.func.value) == "backends" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                found.append(f"{rel}:{node.lineno}")
    assert not found, f"a backend chosen outside qkv.backends.select: {found}"
