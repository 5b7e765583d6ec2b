"""Reading a Llama GGUF file with the ``gguf`` package, and its checks: the file itself (exists, a file, the
``GGUF`` magic, readable), typed metadata with errors naming the file and the key (:class:`Meta`), the
architecture's dimensions, the tensor types ``gguf`` can dequantize, and each tensor dequantized to float32
with the shape the metadata implies. Every error names the file and what was found."""
from __future__ import annotations

import importlib.metadata
import math
import numbers
from pathlib import Path

import numpy as np

INSTALL_HINT = "pip install 'qkv[llama]'"


def gguf_version() -> str:
    try:
        return importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        return "?"


def dequantizable(qtype) -> bool:
    from gguf import GGMLQuantizationType, quants

    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return True
    traits = getattr(quants, "_type_traits", None)
    return True if traits is None else qtype in traits


class Meta:
    """Typed access to a GGUFReader's metadata, with errors that name the file and the key."""

    def __init__(self, reader, path: Path):
        self.reader, self.path = reader, path

    def get(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except Exception as e:  # gguf raises various errors on malformed fields
            raise ValueError(f"{self.path.name}: metadata {key} cannot be read ({e})") from None

    def int(self, key: str, *, required: bool = True, default=None, minimum: int = 1, maximum: int | None = None,
            why: str = ""):
        v = self.get(key)
        if v is None:
            if required:
                raise ValueError(f"{self.path.name}: metadata {key} is missing (not a complete Llama GGUF file)")
            return default
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
            raise ValueError(f"{self.path.name}: metadata {key} should be an integer >= {minimum}, got {v!r}")
        if maximum is not None and v > maximum:
            raise ValueError(f"{self.path.name}: metadata {key} is {int(v):,}; expected at most {maximum:,}{why}")
        return int(v)

    def float(self, key: str, *, default=None):
        v = self.get(key)
        if v is None:
            if default is None:
                raise ValueError(f"{self.path.name}: metadata {key} is missing (not a complete Llama GGUF file)")
            return default
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{self.path.name}: metadata {key} should be a finite number > 0, got {v!r}")
        return float(v)


def open_gguf(file: Path) -> Meta:
    """The file's metadata (its reader inside), after checking that it is a readable GGUF file."""
    import gguf

    if not file.exists():
        raise FileNotFoundError(f"path: no such file: {file}")
    if file.is_dir():
        raise IsADirectoryError(f"path: expected a .gguf file, got the folder {file}")
    with open(file, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ValueError(f"path: {file.name} is not a GGUF file (it starts with {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(str(file))
    except Exception as e:  # gguf raises ValueError/struct errors/IndexError on damaged files
        raise ValueError(f"path: {file.name} cannot be read as GGUF ({type(e).__name__}: {e})") from None
    return Meta(reader, file)


def llama_dims(meta: Meta) -> tuple[int, int, int, int, int, int]:
    """``(layers, D, F, H, Hk, E)`` from the ``llama.*`` metadata, checked to fit together (and RoPE's needs:
    an even head width, full rotation, no scaling); a ValueError for another architecture."""
    name = meta.path.name
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{name}: general.architecture is {arch!r}, expected 'llama'")
    n_layers = meta.int("llama.block_count")
    D = meta.int("llama.embedding_length")
    F = meta.int("llama.feed_forward_length")
    H = meta.int("llama.attention.head_count")
    Hk = meta.int("llama.attention.head_count_kv", required=False, default=H)
    if D % H or H % Hk:
        raise ValueError(f"{name}: embedding_length {D}, head_count {H}, head_count_kv {Hk}: the width must "
                         "be a multiple of the heads and the heads a multiple of the key/value heads")
    E = D // H
    if E % 2:
        raise ValueError(f"{name}: head width {E} is odd; RoPE needs an even width")
    rope_dims = meta.int("llama.rope.dimension_count", required=False, default=E)
    if rope_dims != E:
        raise ValueError(f"{name}: llama.rope.dimension_count is {rope_dims}, expected the head width {E} "
                         "(partial rotary embeddings are not supported)")
    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"{name}: llama.rope.scaling.type is {scaling!r}; RoPE scaling is not supported")
    key_len = meta.int("llama.attention.key_length", required=False, default=E)
    if key_len != E:
        raise ValueError(f"{name}: llama.attention.key_length is {key_len}, expected {E} (embedding_length / "
                         "head_count)")
    return n_layers, D, F, H, Hk, E


def tensor_table(meta: Meta) -> tuple[dict, dict[str, int]]:
    """The file's tensors by name, and the count of each tensor type; a ValueError naming the types ``gguf``
    cannot dequantize, if any."""
    reader = meta.reader
    tensors = {t.name: t for t in reader.tensors}
    kinds: dict[str, int] = {}
    for t in reader.tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    bad = sorted({t.tensor_type.name for t in reader.tensors if not dequantizable(t.tensor_type)})
    if bad:
        where = [t.name for t in reader.tensors if t.tensor_type.name in bad][:3]
        raise ValueError(f"{meta.path.name}: tensor types {bad} cannot be dequantized by gguf {gguf_version()} "
                         f"(e.g. {', '.join(where)}); found types {kinds}")
    return tensors, kinds


def load_tensor(tensors: dict, file: Path, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Tensor ``name`` dequantized to float32, in the (out, in) layout of Hugging Face's Linear weights."""
    from gguf import quants

    t = tensors.get(name)
    if t is None:
        raise ValueError(f"{file.name}: tensor {name} is missing")
    w = quants.dequantize(t.data, t.tensor_type)
    if w.shape != shape:
        raise ValueError(f"{file.name}: tensor {name} has shape {tuple(w.shape)}, expected {shape} from "
                         "the metadata")
    return w.astype(np.float32, copy=False)


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's converter permutation of Q/K weight rows (out, in): within each head, rows were
    reordered from Hugging Face's halves (neox RoPE) to interleaved pairs; this puts them back."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_head, out // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)
