"""The compiled decoding step (issue 43 part 2, :mod:`qkv.models._decode_jit`): one token through every layer in
one call, held to the row-wise path it replaces (the same weights as stored, the same kernels for the norms,
RoPE, SwiGLU and the products; only the attention's loop and the order of its sums differ)."""
import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("numba")

from qkv import KVCache  # noqa: E402
from qkv.models import _decode  # noqa: E402
from qkv.models import load_llama  # noqa: E402
from test_llama_quant import PROMPTS, needs_numba, smollm2  # noqa: E402

pytestmark = [pytest.mark.model, smollm2, needs_numba]
#: compiled vs row-wise logits, max |Δ| measured 1.9e-5 (24 steps after a 30-token prompt, logits up to 33)
MAX_LOGITS = 2e-4


@pytest.fixture(scope="module")
def smol_auto():
    return load_llama(weights="auto")


def _greedy(model, prompt: str, n: int, compiled: bool, monkeypatch, dtype=None) -> tuple[list, np.ndarray]:
    with monkeypatch.context() as m:
        if not compiled:
            m.setattr(_decode, "compiled_step", lambda *a: None)
        caches = model.new_caches(dtype=dtype)
        logits = model.step(model.encode(prompt), caches)
        tok, toks, rows = int(np.argmax(logits[0])), [], []
        for _ in range(n):
            logits = model.step(np.array([[tok]]), caches)
            rows.append(logits[0].copy())
            tok = int(np.argmax(logits[0]))
            toks.append(tok)
    return toks, np.array(rows)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_compiled_step_continues_as_the_row_wise_path(smol_auto, prompt, monkeypatch):
    got, lg = _greedy(smol_auto, prompt, 16, True, monkeypatch)
    want, lw = _greedy(smol_auto, prompt, 16, False, monkeypatch)
    assert got == want
    assert np.abs(lg - lw).max() <= MAX_LOGITS


def _forced(model, prompt: str, toks: list, compiled: bool, monkeypatch, dtype) -> np.ndarray:
    """The logits after each of ``toks`` fed in turn after the prompt."""
    with monkeypatch.context() as m:
        if not compiled:
            m.setattr(_decode, "compiled_step", lambda *a: None)
        caches = model.new_caches(dtype=dtype)
        logits = model.step(model.encode(prompt), caches)
        rows = []
        for tok in [int(np.argmax(logits[0]))] + toks[:-1]:
            rows.append(model.step(np.array([[tok]]), caches)[0].copy())
    return np.array(rows)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_compiled_step_continues_a_float16_cache_as_the_row_wise_path(smol_auto, prompt, monkeypatch):
    """The same attention kernel both ways; the new rows differ by the order of a norm's sums, which float16
    may round one step apart (measured max |Δ logit| 7.6e-3)."""
    got, lg = _greedy(smol_auto, prompt, 16, True, monkeypatch, np.float16)
    want, lw = _greedy(smol_auto, prompt, 16, False, monkeypatch, np.float16)
    assert got == want
    assert np.abs(lg - lw).max() <= 0.02


@pytest.mark.parametrize("prompt", PROMPTS[::2])
def test_the_compiled_step_follows_an_int8_cache_as_the_row_wise_path(smol_auto, prompt, monkeypatch):
    """On the row-wise path's own tokens: an int8 block's scale or number may round one step apart where the
    two paths' new rows differ in their last bits (measured max |Δ logit| 0.22, logits up to 33), so a near
    tie may flip (it does for one of the five prompts)."""
    want, lw = _greedy(smol_auto, prompt, 16, False, monkeypatch, np.int8)
    lg = _forced(smol_auto, prompt, want, True, monkeypatch, np.int8)
    assert np.abs(lg - lw).max() <= 0.5
    assert (lg.argmax(1) == lw.argmax(1)).sum() >= 14


@pytest.mark.parametrize("dtype", [None, np.float16, np.int8])
def test_the_compiled_step_is_taken_and_fills_the_cache_as_the_row_wise_path(smol_auto, monkeypatch, dtype):
    ids = smol_auto.encode("The capital of France is")
    step = _decode.compiled_step(smol_auto, np.array([[1]]), smol_auto.new_caches(dtype=dtype))
    assert step is not None                                          # weights as stored, numba: it applies
    calls = []
    monkeypatch.setattr(step, "step", lambda *a, real=step.step: (calls.append(1), real(*a))[1])
    a, b = smol_auto.new_caches(dtype=dtype), smol_auto.new_caches(dtype=dtype)
    smol_auto.step(ids, a), smol_auto.step(ids, b)
    smol_auto.step(np.array([[42]]), a)
    with monkeypatch.context() as m:
        m.setattr(_decode, "compiled_step", lambda *a: None)
        smol_auto.step(np.array([[42]]), b)
    assert calls == [1] and a[0].offset == b[0].offset == len(ids) + 1
    for ca, cb in zip(a, b):
        for name in ("keys", "values"):
            x, y = getattr(ca, name), getattr(cb, name)
            np.testing.assert_array_equal(x[:, :, :-1], y[:, :, :-1])       # the prompt's: one path
            # the new token's: its RMSNorm is compiled, NumPy's one row; then stored alike (int8: a block's
            # scale may round one step apart, a number then one step of it: 1/127 of the block's largest)
            tol = 1e-5 + (0 if dtype is None else np.abs(y).max() * (1e-3 if dtype is np.float16 else 2 / 127))
            np.testing.assert_allclose(x, y, atol=tol, rtol=0)


def test_the_compiled_step_is_not_taken_where_it_does_not_apply(smol_auto):
    caches = smol_auto.new_caches()
    assert _decode.compiled_step(smol_auto, np.array([[1, 2]]), caches) is None       # a prompt: row-wise
    assert _decode.compiled_step(smol_auto, np.array([[1], [2]]), caches) is None     # a batch of two
    smol_auto.step(np.array([[1, 2], [3, 4]]), caches)
    assert _decode.compiled_step(smol_auto, np.array([[1]]), caches) is None          # caches of a batch
    mixed = smol_auto.new_caches()
    mixed[3] = KVCache(np.float16)                                                   # one layer stored apart
    assert _decode.compiled_step(smol_auto, np.array([[1]]), mixed) is None
    wide = smol_auto.new_caches()
    for cache in wide:
        cache.append(np.zeros((1, 3, 2, 64)), np.zeros((1, 3, 2, 64)))               # float64 rows
    assert _decode.compiled_step(smol_auto, np.array([[1]]), wide) is None


@pytest.mark.parametrize("dtype", [np.float16, np.int8])
def test_a_row_the_cache_cannot_store_is_a_value_error_and_no_cache_keeps_the_token(smol_auto, dtype):
    step = _decode._build(smol_auto, {np.float16: "f16", np.int8: "int8"}[dtype])
    step.attn_norm = step.attn_norm * np.float32(1e30)            # this step's own copy: keys beyond any scale
    caches = smol_auto.new_caches(dtype=dtype)
    smol_auto.step(np.array([[1, 2]]), caches)
    with pytest.raises(ValueError, match=r"key: expected finite values .* got others in layer 0"):
        step(np.array([[3]]), caches)
    assert {c.offset for c in caches} == {2}
    assert smol_auto.step(np.array([[3]]), caches).shape == (1, smol_auto.config.vocab_size)


@pytest.fixture(scope="module")
def smol_int8():
    return load_llama(activations="int8")


def test_int8_activations_follow_the_float32_step_within_their_rounding(smol_int8, smol_auto, monkeypatch):
    """8-bit activations (as llama.cpp) on the float32 step's own tokens: logits within 1.5 of float32
    activations' (measured ≤ 0.96, logits up to 33) and most next tokens the same (near-ties may flip)."""
    same = total = 0
    for prompt in PROMPTS:
        want, lw = _greedy(smol_auto, prompt, 16, True, monkeypatch)
        caches = smol_int8.new_caches()
        smol_int8.step(smol_int8.encode(prompt), caches)
        first = int(np.argmax(smol_auto.step(smol_auto.encode(prompt), smol_auto.new_caches())[0]))
        for tok, row in zip([first] + want[:-1], lw):
            got = smol_int8.step(np.array([[tok]]), caches)[0]
            assert np.abs(got - row).max() <= 1.5
            same += int(np.argmax(got) == np.argmax(row))
            total += 1
    assert same >= 0.8 * total, (same, total)


def test_int8_activations_are_checked():
    with pytest.raises(ValueError, match="activations: expected one of"):
        load_llama(activations="int4")
    with pytest.raises(TypeError, match="activations: expected a str"):
        load_llama(activations=8)
    with pytest.raises(ValueError, match="expected weights='auto'"):
        load_llama(weights="float32", activations="int8")


@pytest.mark.parametrize("dtype", [np.float16, np.int8])
def test_the_row_wise_path_leaves_no_layer_a_token_longer_when_a_row_does_not_fit(smol_auto, dtype, monkeypatch):
    caches = smol_auto.new_caches(dtype=dtype)
    smol_auto.step(np.array([[1, 2]]), caches)
    layer = smol_auto._layers[3]
    with monkeypatch.context() as m:
        m.setattr(layer, "attn_norm", layer.attn_norm * np.float32(1e30))   # layer 3's keys beyond any scale
        with pytest.raises(ValueError, match="key: expected finite values"):
            smol_auto.step(np.array([[3, 4]]), caches)                     # two tokens: the row-wise path
    assert {c.offset for c in caches} == {2}
    assert smol_auto.step(np.array([[3, 4]]), caches).shape == (1, smol_auto.config.vocab_size)
    assert {c.offset for c in caches} == {4}
