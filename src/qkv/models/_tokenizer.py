"""The tokenizer of a Llama GGUF file: a ``tokenizers`` byte-level BPE built from its vocabulary
(``tokenizer.ggml.tokens``), merges and token types, spelled in GPT-2's byte alphabet as transformers' GGUF
loader does."""
from __future__ import annotations

from qkv.models._gguf import INSTALL_HINT, Meta


def gguf_tokenizer(meta: Meta):
    """The file's byte-level BPE as a ``tokenizers.Tokenizer`` (control tokens special, user-defined tokens
    added), or a ValueError naming the file and what is wrong."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise ImportError(f"load_llama needs tokenizers: {INSTALL_HINT}") from None
    name = meta.path.name
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{name}: tokenizer.ggml.model is {kind!r}, expected 'gpt2' (byte-level BPE; other "
                         "tokenizer kinds are not supported)")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or not merges:
        raise ValueError(f"{name}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    types = meta.get("tokenizer.ggml.token_type") or []
    # Byte-level vocabularies spell every byte with one printable character (GPT-2's table); a token written
    # otherwise is spelled in that alphabet, as transformers' GGUF loader does.
    alphabet = byte_alphabet()
    spelling = {b: c for b, c in enumerate(alphabet)}
    letters = set(alphabet)
    vocab = {}
    for i, t in enumerate(tokens):
        key = t if set(t) <= letters else "".join(spelling[b] for b in t.encode("utf-8"))
        vocab.setdefault(key, i)
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ValueError(f"{name}: merge {m!r} in tokenizer.ggml.merges is not two tokens")
        pairs.append((a, b))
    tok = Tokenizer(models.BPE(vocab, pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
               if ty == 3 and set(t) <= letters]                       # 3: CONTROL, e.g. <|im_start|>
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
            if ty == 4 and t in vocab]                                 # 4: USER_DEFINED
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    return tok


def byte_alphabet() -> list[str]:
    """GPT-2's bytes → printable characters table: entry b spells byte b."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]
