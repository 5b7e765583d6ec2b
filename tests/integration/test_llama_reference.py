"""qkv's SmolLM2 decoder against transformers' LlamaForCausalLM loading the same GGUF file, in float32.

transformers dequantizes the file with the same ``gguf`` package and undoes the same Q/K permutation, so both
sides hold the same float32 weights. Bounds from issue 10: logits max |Δ| ≤ 1e-3, attention weights ≤ 1e-5,
hidden states ≤ 1e-3 where |h| ≤ 10 and 1e-4 relative beyond (see _check_hidden: float32 cannot do 1e-3
absolute at |h| ≈ 26,000), the per-head Q, K (after RoPE) and V ≤ 1e-3, on English, Chinese, code and emoji
prompts and a padded batch of all four; greedy continuations of 32 tokens identical token for token; tokenizer
ids identical; the chat template rendered identically. Cached decoding equal to the full forward is in tests/integration/test_llama.py (no reference needed).

transformers' GGUF load takes 25–70 s, so it runs once per test session: the first worker to get here loads
it, computes every reference number below and saves them (pickle) in the session's shared temporary folder;
the other xdist workers wait on a file lock and read them.
"""
import os
import pickle

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("accelerate")
filelock = pytest.importorskip("filelock")

from qkv.models.llama import default_model_path, load_llama  # noqa: E402

try:
    default_model_path()
except ImportError as exc:  # pragma: no cover - the Makefile installs it
    pytest.skip(str(exc), allow_module_level=True)

pytestmark = [pytest.mark.model, pytest.mark.torch]

PROMPTS = {
    "english": "The animal didn't cross the street because it was too tired. It",
    "chinese": "我们在北京学习中文，因为",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "emoji": "I love pizza 🍕 and sunshine ☀️! My favourite emoji is 👍🏽 because",
}
TOKENIZER_TEXTS = list(PROMPTS.values()) + [
    "Hello world 2024! 3.14159 and 1,000,000 people.", "  leading spaces\tand\ttabs\n\nnew lines   ",
    "<|im_start|>user\nhi<|im_end|>", "naïve café résumé Ünïcödé", "日本語のテキストと한국어 텍스트",
    "x = [i**2 for i in range(10)]  # squares", "🏳️‍🌈👩‍👩‍👧‍👦",
]
CHAT = "What is the capital of France?"
NEW_TOKENS = 32
MAX_LOGITS, MAX_ATTN, MAX_HIDDEN = 1e-3, 1e-5, 1e-3


def _hf_model():
    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32, attn_implementation="eager")
    return tok, model.eval()


def _hf_forward(model, ids, mask):
    """Logits, hidden states, attentions and per-head Q, K (after RoPE), V from hooks on the projections."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = model.config
    H, Hk, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    captured, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(
                lambda m, inp, out, key=(i, name): captured.__setitem__(key, out.detach())))
    try:
        with torch.no_grad():
            ids_t = torch.from_numpy(ids)
            o = model(input_ids=ids_t, attention_mask=torch.from_numpy(mask.astype(np.int64)),
                      output_attentions=True, output_hidden_states=True, use_cache=False)
            B, T = ids.shape
            pos = torch.arange(T)[None].expand(B, T)
            cos, sin = model.model.rotary_emb(captured[(0, "q_proj")], pos)
            q, k, v = [], [], []
            for i in range(cfg.num_hidden_layers):
                qi = captured[(i, "q_proj")].view(B, T, H, E).transpose(1, 2)
                ki = captured[(i, "k_proj")].view(B, T, Hk, E).transpose(1, 2)
                qr, kr = apply_rotary_pos_emb(qi, ki, cos, sin)
                q.append(qr.numpy())
                k.append(kr.numpy())
                v.append(captured[(i, "v_proj")].view(B, T, Hk, E).transpose(1, 2).numpy())
    finally:
        for h in hooks:
            h.remove()
    return {"logits": o.logits.numpy(), "hidden": [h.numpy() for h in o.hidden_states],
            "attentions": [a.numpy() for a in o.attentions], "q": q, "k": k, "v": v}


def _compute_reference(ours):
    """Everything the tests compare, from transformers (one load)."""
    tok, model = _hf_model()
    ref = {"tokenizer": {t: tok(t, add_special_tokens=True)["input_ids"] for t in TOKENIZER_TEXTS},
           "chat": tok.apply_chat_template([{"role": "user", "content": CHAT}], tokenize=False,
                                           add_generation_prompt=True),
           "eos": model.generation_config.eos_token_id}
    texts = list(PROMPTS.values())
    _, ids, mask = ours._batch(texts)                                  # right-padded with the pad id
    ref["batch_ids"], ref["batch_mask"] = ids, mask
    ref["batch"] = _hf_forward(model, ids, mask)
    ref["single"] = {}
    ref["greedy"] = {}
    for name, text in PROMPTS.items():
        ids1 = np.asarray([tok(text)["input_ids"]], dtype=np.int64)
        r = _hf_forward(model, ids1, np.ones_like(ids1, dtype=bool))
        ref["single"][name] = {"logits": r["logits"], "hidden": r["hidden"], "attentions": r["attentions"]}
        with torch.no_grad():
            out = model.generate(torch.from_numpy(ids1), attention_mask=torch.ones_like(torch.from_numpy(ids1)),
                                 max_new_tokens=NEW_TOKENS, do_sample=False)
        ref["greedy"][name] = out[0, ids1.shape[1]:].tolist()
    chat_ids = np.asarray([tok(ref["chat"], add_special_tokens=False)["input_ids"]], dtype=np.int64)
    with torch.no_grad():
        out = model.generate(torch.from_numpy(chat_ids), attention_mask=torch.ones_like(torch.from_numpy(chat_ids)),
                             max_new_tokens=NEW_TOKENS, do_sample=False)
    ref["greedy"]["chat"] = out[0, chat_ids.shape[1]:].tolist()
    return ref


@pytest.fixture(scope="module")
def ours():
    return load_llama()


@pytest.fixture(scope="module")
def ref(ours, tmp_path_factory, request):
    if not hasattr(request.config, "workerinput"):                     # not under xdist: no one to share with
        return _compute_reference(ours)
    shared = tmp_path_factory.getbasetemp().parent / "qkv_llama_reference.pkl"
    with filelock.FileLock(str(shared) + ".lock"):
        if shared.is_file():
            return pickle.loads(shared.read_bytes())
        data = _compute_reference(ours)
        shared.write_bytes(pickle.dumps(data))
        return data


def _maxdiff(a, b, rows=None):
    d = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    return float(d[rows].max() if rows is not None else d.max())


def _check_hidden(ours, ref, rows=None):
    """Hidden states: |Δ| ≤ 1e-3 where |h| ≤ 10, and |Δ| ≤ 1e-4 · |h| beyond (1e-3 · max(1, |h| / 10)).

    An absolute 1e-3 cannot hold for every entry in float32: SmolLM2's residual stream reaches |h| ≈ 2,000 in
    ordinary channels and ≈ 26,000 in two channels of massive activations (260, 507), where one float32 step
    is 0.00012 and 0.002; any two float32 implementations summing in another order differ there by a few
    steps (measured up to 0.03 absolute, 3e-5 relative). Returns (max |Δ| where |h| ≤ 10, max |Δ| / max(10, |h|)).
    """
    worst_small = worst_rel = 0.0
    for i, (h, hr) in enumerate(zip(ours, ref)):
        h, hr = np.asarray(h, np.float64), np.asarray(hr, np.float64)
        if rows is not None:
            h, hr = h[rows], hr[rows]                                  # real tokens only
        d, a = np.abs(h - hr), np.abs(hr)
        worst_small = max(worst_small, float(d[a <= 10].max()))
        worst_rel = max(worst_rel, float((d / np.maximum(10.0, a)).max()))
        assert (d <= MAX_HIDDEN * np.maximum(1.0, a / 10)).all(), (i, float(d.max()))
    return worst_small, worst_rel


def test_tokenizer_ids_identical(ours, ref):
    for text, ids in ref["tokenizer"].items():
        assert ours.encode(text) == ids, text


def test_chat_template_rendered_identically(ours, ref):
    assert ours.apply_chat_template(CHAT) == ref["chat"]


def test_padded_batch_matches(ours, ref):
    out = ours.run(list(PROMPTS.values()))
    np.testing.assert_array_equal(out.input_ids, ref["batch_ids"])
    mask = out.attention_mask
    assert not mask.all(), "the batch should need padding"
    r = ref["batch"]
    assert _maxdiff(out.logits, r["logits"], mask) <= MAX_LOGITS
    assert len(out.hidden_states) == len(r["hidden"]) == ours.config.num_layers + 1
    # transformers' last hidden state is after the final norm; qkv keeps the layer output and the normed one
    _check_hidden(out.hidden_states[:-1] + [out.final_hidden_state], r["hidden"], mask)
    rows = np.broadcast_to(mask[:, None, :, None], out.attentions[0].shape)     # real query rows
    heads_rows = lambda a: np.broadcast_to(mask[:, None, :, None], a.shape)     # noqa: E731
    for i in range(ours.config.num_layers):
        assert _maxdiff(out.attentions[i], r["attentions"][i], rows) <= MAX_ATTN, i
        assert _maxdiff(out.queries[i], r["q"][i], heads_rows(r["q"][i])) <= MAX_HIDDEN, i
        assert _maxdiff(out.keys[i], r["k"][i], heads_rows(r["k"][i])) <= MAX_HIDDEN, i
        assert _maxdiff(out.values[i], r["v"][i], heads_rows(r["v"][i])) <= MAX_HIDDEN, i


@pytest.mark.parametrize("name", list(PROMPTS))
def test_single_prompt_matches(ours, ref, name):
    out = ours.run(PROMPTS[name])
    r = ref["single"][name]
    assert _maxdiff(out.logits, r["logits"]) <= MAX_LOGITS
    _check_hidden(out.hidden_states[:-1] + [out.final_hidden_state], r["hidden"])
    for a, ar in zip(out.attentions, r["attentions"]):
        assert _maxdiff(a, ar) <= MAX_ATTN


@pytest.mark.parametrize("name", list(PROMPTS) + ["chat"])
def test_greedy_continuations_identical(ours, ref, name):
    if name == "chat":
        g = ours.generate(CHAT, max_new_tokens=NEW_TOKENS, chat=True)
    else:
        g = ours.generate(PROMPTS[name], max_new_tokens=NEW_TOKENS)
    expected = ref["greedy"][name]
    eos = ref["eos"]
    # transformers pads a sequence that ended early with the pad token; qkv stops at the end-of-sequence token
    if eos in expected:
        expected = expected[:expected.index(eos) + 1]
    assert g.ids == expected
