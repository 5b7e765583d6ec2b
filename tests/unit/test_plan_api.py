"""qkv.plan (issue 39): a call's plan, made by the code the call runs, without computing attention — its backend
and reason, its tasks' strategies and reasons, its pieces; printed as a table; ``qkv bench --plan``."""
import numpy as np
import pytest

import qkv
from qkv import mods as M

from cli_checks import one_line, run


def _qkv(n=1024, heads=2, seed=0, scale=1.0):
    r = np.random.default_rng(seed)
    return tuple((r.standard_normal((1, heads, n, 64)) * scale).astype(np.float32) for _ in range(3))


def test_a_packed_documents_plan_says_what_runs_and_why():
    pytest.importorskip("numba")
    q, k, v = _qkv()
    bm = qkv.create_block_mask(M.document(np.arange(1024) // 200), None, None, 1024, 1024)
    with qkv.paths.counting() as seen:
        p = qkv.plan(q, k, v, block_mask=bm)
    assert not seen.get("forward.tile_loop")                      # nothing ran
    assert p.backend == "tiled" and p.reason.startswith("auto:")
    assert p.strategies() == {"compiled loop, tiles": len(p.tasks)}
    assert all("block mask" in t.reason for t in p.tasks)
    assert 0.15 < p.work_fraction() < 0.25                        # five documents of 200: ~0.19 of the scores
    text = str(p)
    assert "compiled loop, tiles [a]" in text and "work fraction" in text and "[a] compiled loop, tiles:" in text
    pieces = str(p.tasks[0])
    assert pieces.splitlines()[0].split() == ["piece", "rows", "keys", "upper", "lower", "tile", "masks", "fresh"]
    qkv.check_plan(p)
    with qkv.paths.counting() as seen:
        qkv.flex_attention(q, k, v, None, bm)
    assert seen["forward.tile_loop"] == len(p.tasks)              # the run took what the plan said


def test_the_python_loop_s_reason_says_why_no_compiled_loop_took_it(numpy_kernels):
    q, k, v = _qkv()
    p = qkv.plan(q, k, v, is_causal=True, backend="tiled")
    assert set(p.strategies()) <= {"shift-free blocks", "rescaled blocks"}
    assert all("no compiled loop: no fused kernels" in t.reason for t in p.tasks)
    qkv.check_plan(p)


def test_a_backward_plan_and_a_small_call_on_the_reference():
    q, k, v = _qkv()
    p = qkv.plan(q, k, v, is_causal=True, backward=True)
    assert p.direction == "backward" and p.backend == "tiled" and p.tasks
    qkv.check_plan(p)
    small = qkv.plan(*(a[:, :, :16] for a in (q, k, v)), is_causal=True)
    assert small.backend == "reference" and not small.tasks and "size rule" in small.reason
    assert "no tasks" in str(small)
    with pytest.raises(ValueError, match="plan: expected a plan of the tiled engine"):
        qkv.backends.tiled.proof.check(small)


def test_bad_arguments_are_the_calls_errors():
    q, k, v = _qkv(64)
    with pytest.raises(TypeError, match="block_mask"):
        qkv.plan(q, k, v, block_mask=lambda b, h, i, j: i >= j)
    with pytest.raises(ValueError, match="key"):
        qkv.plan(q, k[..., :8], v)
    with pytest.raises(ValueError, match="score_mod: .* has no derivative"):
        qkv.plan(q, k, v, score_mod=lambda s, b, h, i, j: s * 2, backward=True, backend="tiled")


def test_bench_plan_prints_the_cases_plans(capsys):
    code, out, err = run(capsys, "bench", "--plan", "--lengths", "512", "--modes", "forward,causal", "--heads", 2)
    assert code == 0, err
    assert "== N = 512, forward" in out and "== N = 512, causal" in out and "strategies:" in out
    code, out, err = run(capsys, "bench", "--plan", "--variants", "--cases", "documents", "--heads", 1)
    assert code == 0 and "8 packed documents of 1024" in out and "work fraction 0.125" in out, err
    one_line(*run(capsys, "bench", "--plan", "--json", "out.json")[::2], "not offered with --plan")


@pytest.mark.parametrize("backward", [False, True])
def test_planning_leaves_the_problem_as_it_was(backward):
    """The problem is inputs only: the setup returns the problem as cut (a copy), the one given keeps every field."""
    from qkv.backends.tiled import plan as tp, setup
    r = np.random.default_rng(1)
    q = r.standard_normal((1, 6, 512, 64), dtype=np.float32)
    k, v = (r.standard_normal((1, 2, 512, 64), dtype=np.float32) for _ in range(2))
    P = tp._Problem(q, k, v, None, True, 0.125, True, backward=backward)
    before = dict(vars(P))
    got = setup.backward_setup(P, None, None, 2) if backward else setup.forward_setup(P, None, None, 2, 0.0, False)
    assert vars(P).keys() == before.keys() and all(vars(P)[name] is before[name] for name in before)
    assert P.cut == tp.Cut() and got.problem is not P
    if not backward:
        assert got.problem.group == 3                     # the grouped heads, in the cut problem only


def test_the_engine_page_shows_the_plan_qkv_plan_prints():
    """docs/engine.md's plan table is qkv.plan's own output for its example (on 2 workers with the numba kernels:
    the machine the page names), so the page cannot drift from the engine."""
    pytest.importorskip("numba")
    import pathlib
    import re
    if qkv.get_num_threads() != 2:
        pytest.skip("the page's table is for 2 workers")
    page = (pathlib.Path(__file__).parents[2] / "docs" / "engine.md").read_text()
    shown = re.search(r"prints \(2-core.*?\n\n```text\n(.*?)```", page, re.S).group(1).rstrip("\n")
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 1024, 64), dtype=np.float32) for _ in range(3))
    docs = M.document(np.arange(1024) // 200)
    bm = qkv.create_block_mask(M.and_masks(M.causal(), docs), None, None, 1024, 1024)
    assert str(qkv.plan(q, k, v, block_mask=bm)) == shown


@pytest.mark.parametrize("mod, want", [
    ("alibi", "batched bands"), ("softcap", "batched bands"), ("both", "batched bands"),
    ("negative alibi", "rescaled blocks"), ("custom", "rescaled blocks"), (None, "compiled loop, tiles")])
def test_a_window_s_strategy_under_each_score_mod(mod, want):
    """Which strategy a sliding window takes under each mod (what the plan reports is what runs): the batched
    bands carry ALiBi and the softcap; a negative slope (scores not bounded by the diagonal's) and a custom mod
    need the running max."""
    pytest.importorskip("numba")
    q, k, v = _qkv(scale=0.1)
    slopes = M.alibi_slopes(2)
    mods = {"alibi": M.alibi(slopes), "softcap": M.softcap(20.0), "both": M.compose(M.alibi(slopes), M.softcap(20.0)),
            "negative alibi": M.alibi(-slopes), None: None,
            "custom": M.ScoreMod(lambda s, b, h, i, j: s * 0.5, grad=lambda s, b, h, i, j: np.full_like(s, 0.5))}
    bm = qkv.create_block_mask(M.sliding_window(200), None, None, 1024, 1024)
    p = qkv.plan(q, k, v, block_mask=bm, score_mod=mods[mod], backend="tiled")
    assert p.strategies() == {want: len(p.tasks)}
    qkv.check_plan(p)
    with qkv.paths.counting() as seen:
        qkv.flex_attention(q, k, v, mods[mod], bm, backend="tiled")
    path = {"batched bands": "forward.bands", "rescaled blocks": "forward.max_pass",
            "compiled loop, tiles": "forward.tile_loop"}[want]
    assert seen.get(path)
