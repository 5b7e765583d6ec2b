"""load_llama(weights=...): the projections and the LM head kept as the GGUF file stores them
(:class:`qkv.models._quant.QuantMatrix`, ``weights="auto"``) against every tensor dequantized to float32
(``weights="float32"``, as before).

QuantMatrix against gguf itself: ``dequantize()`` equals ``gguf.quants.dequantize`` bit for bit (blocks from
``gguf.quants.quantize`` where gguf quantizes the type, Q4_0/Q4_1/Q8_0; random valid bytes for Q4_K/Q6_K, which
gguf only dequantizes), and on SmolLM2's own tensors equals what the float32 load holds (Q and K rows put back in
Hugging Face's order: a permutation of whole rows of blocks). Since both hold the same values, the logits differ
only by the order of float32 sums: at most 9.2e-5 measured over five prompts (logits up to 41), bounded here by
5e-4; greedy continuations (16 tokens, five prompts) are identical. The unit tests of QuantMatrix (no gguf) are
tests/unit/test_quant.py.
"""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from qkv.models import _gguf, _llama_load, _quant, load_llama  # noqa: E402
from qkv.models._quant import QuantMatrix  # noqa: E402
from qkv.models.llama import default_model_path  # noqa: E402
from test_llama import LAYERS, hf_llama_logits, smollm2, write_tiny_llama  # noqa: E402
from test_quant import ROWS, SHAPES, _check_product, _same, random_blocks  # noqa: E402

T = gguf.GGMLQuantizationType
#: auto vs float32 logits: max |Δ| measured 9.2e-5 (forward and cached steps, five prompts, logits up to 41)
MAX_LOGITS = 5e-4
PROMPTS = ["The animal didn't cross the street because it was too tired. It", "我们在北京学习中文，因为",
           "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "I love pizza 🍕 and sunshine ☀️! My favourite emoji is 👍🏽 because", "The capital of France is"]
needs_numba = pytest.mark.skipif(_quant._kernels() is None, reason="numba is not installed: auto is float32")




@pytest.fixture(scope="module")
def smol_auto():
    return load_llama(weights="auto")


@pytest.fixture(scope="module")
def smol_f32():
    return load_llama(weights="float32")


# ---------------------------------------------------------------------------------------------- against gguf
@pytest.mark.parametrize("name", ["F32", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_quant_matrix_equals_ggufs_dequantize(name):
    rng = np.random.default_rng(0)
    for out, k in SHAPES[name]:
        if name in ("Q4_0", "Q4_1", "Q8_0"):
            data = gguf.quants.quantize(rng.normal(0, 0.1, (out, k)).astype(np.float32), T[name])
        else:                                                        # gguf dequantizes these, never quantizes
            data = random_blocks(name, out, k)
        m = QuantMatrix(data, T[name], (out, k))                     # gguf's enum names the type too
        w = gguf.quants.dequantize(data, T[name]).astype(np.float32)
        assert _same(m.dequantize(), w), (name, out, k)
        for n in ROWS:
            x = rng.normal(size=(n, k)).astype(np.float32)
            _check_product(m.matmul(x), x, w)


@pytest.mark.model
@smollm2
def test_smollm2_tensors_as_stored_dequantize_to_what_the_float32_load_reads():
    reader = gguf.GGUFReader(str(default_model_path()))
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.attn_q.weight", "blk.7.ffn_gate.weight", "blk.29.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        shape = (int(t.shape[1]), int(t.shape[0]))
        m = QuantMatrix(np.asarray(t.data), t.tensor_type, shape)
        assert m.qtype == ("Q8_0" if name == "token_embd.weight" else "Q4_1")
        assert _same(m.dequantize(), _gguf.load_tensor(tensors, default_model_path(), name, shape))


# ---------------------------------------------------------------------------------------------- SmolLM2
@pytest.mark.model
@smollm2
@needs_numba
def test_smollm2_auto_holds_the_files_bytes_with_the_float32_loads_values(smol_auto, smol_f32):
    layers = smol_auto._layers
    weights = [w for lyr in layers for w in (lyr.w_qkv, lyr.w_o, lyr.w_gate_up, lyr.w_down)]
    assert all(isinstance(w, QuantMatrix) and w.qtype == "Q4_1" for w in weights)
    head = smol_auto._lm_head_t
    assert isinstance(head, QuantMatrix) and head.qtype == "Q8_0" and smol_auto._embed is None
    assert sum(w.nbytes for w in weights) + head.nbytes < 97e6                 # 96.4 MB read per token
    for a, f in zip(layers, smol_f32._layers):                                  # Q, K rows unpermuted alike
        for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            assert _same(np.ascontiguousarray(getattr(a, name).dequantize().T), getattr(f, name)), name
    assert _same(np.ascontiguousarray(head.dequantize().T), smol_f32._lm_head_t)
    ids = np.array([[0, 5, 49151], [17, 17, 2]])
    assert _same(smol_auto.embed(ids), smol_f32.embed(ids))
    a, f = smol_auto.attention[3], smol_f32.attention[3]                       # built when asked for
    for w in ("W_Q", "W_K", "W_V", "W_O"):
        assert _same(np.ascontiguousarray(getattr(a, w)), np.ascontiguousarray(getattr(f, w)))


@pytest.mark.model
@smollm2
def test_smollm2_auto_logits_equal_float32_logits(smol_auto, smol_f32):
    for prompt in PROMPTS:
        ids = smol_auto.encode(prompt)
        assert np.abs(smol_auto.forward(ids) - smol_f32.forward(ids)).max() <= MAX_LOGITS
        if prompt not in PROMPTS[:2]:
            continue
        steps = []
        for model in (smol_auto, smol_f32):                                    # the decoding path: 1-row products
            caches = model.new_caches()
            first = model.step(ids[:3], caches, last_only=False)[0]
            steps.append(np.concatenate([first, np.stack([model.step([i], caches)[0] for i in ids[3:]])]))
        assert np.abs(steps[0] - steps[1]).max() <= MAX_LOGITS
    a, f = smol_auto.run(PROMPTS[:2]), smol_f32.run(PROMPTS[:2])
    assert np.abs(a.logits - f.logits).max() <= MAX_LOGITS


@pytest.mark.model
@smollm2
def test_smollm2_greedy_continuations_are_identical(smol_auto, smol_f32):
    for prompt in PROMPTS:
        a, f = smol_auto.generate(prompt, max_new_tokens=16), smol_f32.generate(prompt, max_new_tokens=16)
        assert a.ids == f.ids and a.text == f.text, prompt


# ---------------------------------------------------------------------------------------------- a tiny file
@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama-q4_1.gguf"
    return path, write_tiny_llama(path, q_type=T.Q4_1)               # Q4_1 layers, F16 tied embeddings


def test_float32_weights_are_as_before(tiny_file):
    path, ref = tiny_file
    model = load_llama(path, weights="float32")
    for lyr in model._layers:
        assert all(isinstance(w, np.ndarray) and w.dtype == np.float32
                   for w in (lyr.w_qkv, lyr.w_o, lyr.w_gate_up, lyr.w_down))
        assert np.shares_memory(lyr.attention.W_Q, lyr.w_qkv) and lyr.attention.W_O is lyr.w_o
    for i, mha in enumerate(model.attention):
        assert _same(np.ascontiguousarray(mha.W_Q), np.ascontiguousarray(ref[f"blk.{i}.q"].T))
    ids = model.encode("hello the world, hello!")
    assert np.abs(model.forward(ids)[0] - hf_llama_logits(ref, ids)).max() < 2e-4


@needs_numba
def test_auto_keeps_the_projections_quantized_and_computes_the_same_model(tiny_file, monkeypatch):
    path, ref = tiny_file
    model = load_llama(path)                                         # weights="auto", the default
    assert all(isinstance(w, QuantMatrix) for lyr in model._layers
               for w in (lyr.w_qkv, lyr.w_o, lyr.w_gate_up, lyr.w_down))
    assert isinstance(model._lm_head_t, np.ndarray)                  # F16: a type QuantMatrix does not read
    assert all(lyr.mha is None for lyr in model._layers)             # the modules: only when asked for
    for i, mha in enumerate(model.attention):
        for w, key in (("W_Q", "q"), ("W_K", "k"), ("W_V", "v"), ("W_O", "o")):
            assert _same(np.ascontiguousarray(getattr(mha, w)), np.ascontiguousarray(ref[f"blk.{i}.{key}"].T))
    ids = model.encode("hello the world, hello!")
    expected = hf_llama_logits(ref, ids)
    seen = []
    real = QuantMatrix.matmul

    def counting(self, x, out=None):
        seen.append(id(self))
        return real(self, x, out=out)
    monkeypatch.setattr(QuantMatrix, "matmul", counting)
    assert np.abs(model.forward(ids)[0] - expected).max() < 2e-4
    assert {id(w) for lyr in model._layers for w in (lyr.w_qkv, lyr.w_o, lyr.w_gate_up, lyr.w_down)} <= set(seen)
    assert np.abs(model.run("hello the world, hello!").logits[0] - expected).max() < 2e-4
    g = model.generate("hello the", max_new_tokens=6)
    assert g.ids == load_llama(path, weights="float32").generate("hello the", max_new_tokens=6).ids


def test_auto_is_float32_without_numba_or_with_the_numpy_kernels(tiny_file, monkeypatch, numpy_kernels):
    path, _ = tiny_file
    model = load_llama(path)                                         # kernels "numpy" (the fixture)
    assert isinstance(model._layers[0].w_qkv, np.ndarray)
    monkeypatch.setattr(numpy_kernels, "choice", "auto")
    monkeypatch.setattr(_quant, "_kernels", lambda: None)            # as without the jit extra
    assert isinstance(load_llama(path)._layers[0].w_gate_up, np.ndarray)


def test_types_that_quant_matrix_does_not_read_stay_float32(tmp_path):
    path = tmp_path / "f16.gguf"
    ref = write_tiny_llama(path, q_type=T.F16)
    model = load_llama(path)
    assert len(model._layers) == LAYERS and all(isinstance(lyr.w_down, np.ndarray) for lyr in model._layers)
    ids = model.encode("hello the world")
    assert np.abs(model.forward(ids)[0] - hf_llama_logits(ref, ids)).max() < 2e-4


def test_weights_argument_errors_name_it():
    with pytest.raises(ValueError, match=r"weights: expected one of \('auto', 'float32'\), got 'int4'"):
        load_llama(weights="int4")
    with pytest.raises(TypeError, match=r"weights: expected a str, one of \('auto', 'float32'\), got int"):
        load_llama(weights=4)
    assert _llama_load.WEIGHTS == ("auto", "float32")
