"""What :func:`qkv.viz.render_page` / :func:`write_page` take, checked before a page is written.

One convention: each ``*_data`` function returns the value of one key of the page's data —
``{"playground": playground_data(…) or from_worked(…), "example": worked_data(…), "model": model_data(…),
"generation": generation_data(…), "why": why_data(), "notices": […]}`` (any of them). Two values carry more than
their own view, and :func:`normalize` puts it where the page reads it:

- :func:`~qkv.viz.worked_data` is a worked example at any size: the editable playground when small (it goes
  to ``playground``), the canvas picture when large, or only a notice when too large (with the notice
  saying why);
- :func:`~qkv.viz.generation_data` carries the model view of the whole sequence (``"model"``), which becomes
  the page's model view unless one is given.

A value that does not have its view's shape is a ValueError naming the key, what it expected and what it got
(a page written from it would fail in the browser).
"""
from __future__ import annotations

PARTS = ("playground", "model", "example", "generation", "compare", "long", "why")
#: The views a page may open on (``data["first"]``): the page's title names its model and input, the view comes
#: first, and the playground and "Why ÷ √d_k" are folded below it (one click away).
FIRST = ("model", "generation", "compare", "long")
#: The keys of each view's dict that the page reads, and where such a dict comes from.
REQUIRED = {
    "playground": (("title", "start", "tokens", "heads", "causal", "scaling"),
                   "playground_data()'s, from_worked()'s or worked_data()'s dict"),
    "model": (("kind", "name", "layers", "heads", "T", "maps", "tokens"), "model_data()'s dict"),
    "example": (("kind", "name", "layers", "heads", "T", "maps", "tokens"), "worked_data()'s dict"),
    "generation": (("name", "prompt", "text", "tokens", "prompt_len", "layers", "heads", "steps"),
                   "generation_data()'s dict"),
    "compare": (("kind", "name", "name_b", "text", "tokens", "T", "pairs", "maps", "table"),
                "compare_data()'s dict (qkv.viz.page_hf)"),
    "long": (("kind", "name", "layers", "heads", "T", "tokens", "summary", "pooled", "rows"),
             "long_data()'s dict (qkv.viz.page_long)"),
    "why": (("scale", "examples"), "why_data()'s dict"),
}
_STARTS = ("X", "QK", "scores")
_MAP_KEYS = ("tables", "table_of", "blobs", "shapes")


def _got(value) -> str:
    if isinstance(value, dict):
        keys = sorted(map(str, value))
        shown = ", ".join(keys[:6]) + (", …" if len(keys) > 6 else "")
        return f"a dict with keys [{shown}]" if keys else "an empty dict"
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '…' if len(text) > 40 else text}"


def _fail(key: str, value, why: str = "") -> ValueError:
    return ValueError(f"{key}: expected {REQUIRED[key][1]}{why}, got {_got(value)}")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _maps_ok(maps, count: int) -> bool:
    return (isinstance(maps, dict) and all(isinstance(maps.get(k), list) for k in _MAP_KEYS)
            and len(maps["blobs"]) == count)


def check(key: str, value) -> None:
    """ValueError unless ``value`` has the shape of the page's ``key`` view."""
    need, _ = REQUIRED[key]
    if not isinstance(value, dict) or any(k not in value for k in need):
        missing = [k for k in need if not isinstance(value, dict) or k not in value]
        raise _fail(key, value, f" (with {', '.join(missing)})")
    tokens = value.get("tokens")
    if key != "why" and not (isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)):
        raise _fail(key, value, " (tokens: a list of strings)")
    if key == "playground":
        if value["start"] not in _STARTS or not _int(value["heads"]):
            raise _fail(key, value, f" (start: one of {', '.join(_STARTS)}; heads ≥ 1)")
        if value.get("kind", "playground") != "playground":
            raise _fail(key, value, f" (kind 'playground', not {value['kind']!r})")
    elif key in ("model", "example"):
        if value["kind"] != key:
            raise _fail(key, value, f" (kind {key!r}, not {value['kind']!r})")
        L, H, T = value["layers"], value["heads"], value["T"]
        if not (_int(L) and _int(H) and _int(T) and len(tokens) == T and _maps_ok(value["maps"], L * H)):
            raise _fail(key, value, " (layers × heads coded maps of T tokens)")
    elif key == "compare":
        pairs, T = value["pairs"], value["T"]
        if not (value["kind"] == "compare" and _int(T) and len(tokens) == T and isinstance(pairs, list) and pairs
                and _maps_ok(value["maps"], 2 * len(pairs)) and isinstance(value["table"], list)
                and len(value["table"]) == len(pairs)):
            raise _fail(key, value, " (two coded maps per compared head of T tokens, one table row each)")
    elif key == "long":
        L, H, T = value["layers"], value["heads"], value["T"]
        if not (value["kind"] == "long" and _int(L) and _int(H) and _int(T) and len(tokens) == T
                and _maps_ok(value["pooled"], L * H) and isinstance(value["rows"], list)
                and (not value["rows"] or _maps_ok(value.get("exact"), L * H))):
            raise _fail(key, value, " (layers × heads pooled maps of T tokens, and the chosen rows' maps)")
    elif key == "generation":
        if not (_int(value["layers"]) and _int(value["heads"]) and isinstance(value["steps"], dict)
                and isinstance(value["steps"].get("blobs"), list)):
            raise _fail(key, value, " (layers, heads and the coded steps)")
    elif not (isinstance(value["scale"], dict) and value["scale"].get("rows")
              and isinstance(value["examples"], list) and len(value["examples"]) == len(value["scale"]["rows"])):
        raise _fail(key, value, " (the scale experiment and one example row per d_k)")


def _notices(value, key: str = "notices") -> list:
    if value is None:
        return []
    if not isinstance(value, list) or not all(
            isinstance(n, dict) and isinstance(n.get("key"), str) and n["key"].startswith("page.")
            and isinstance(n.get("args", {}), dict) for n in value):
        raise ValueError(f"{key}: expected a list of {{'key': 'page.…', 'args': {{…}}}}, got {_got(value)}")
    return [{"key": n["key"], "args": dict(n.get("args", {}))} for n in value]


def normalize(data) -> dict:
    """``data`` as the page reads it: every view checked (:func:`check`), :func:`~qkv.viz.worked_data`'s value
    put where it belongs and :func:`~qkv.viz.generation_data`'s model view lifted; returns
    ``{part: value or None, …, "notices": […]}``. TypeError when ``data`` is not a dict; ValueError naming an
    unknown key, a value of the wrong shape, or nothing to show."""
    if not isinstance(data, dict):
        raise TypeError(f"data: expected a dict of the page's views ({', '.join(PARTS)}, notices), "
                        f"got {type(data).__name__}")
    unknown = [k for k in data if k not in PARTS + ("notices", "lang", "first")]
    if unknown:
        raise ValueError(f"data: unknown key {unknown[0]!r}; expected {', '.join(PARTS)}, notices, lang or first")
    out = {k: data.get(k) for k in PARTS}
    notices = _notices(data.get("notices"))
    ex = out["example"]
    if isinstance(ex, dict) and "notices" in ex:                     # worked_data: its notices join the page's
        notices += _notices(ex["notices"], "example['notices']")
        ex = {k: v for k, v in ex.items() if k != "notices"}
        out["example"] = None if ex.get("kind") == "notice" and len(ex) == 1 else ex
    ex = out["example"]
    if isinstance(ex, dict) and ex.get("kind") == "playground":       # worked_data of a small example
        if out["playground"] is not None:
            raise ValueError("example: worked_data() gave the playground, and playground is given too; give one")
        out["playground"], out["example"] = ex, None
    gen = out["generation"]
    if isinstance(gen, dict) and "model" in gen:                     # generation_data: the sequence's model view
        out["generation"] = {k: v for k, v in gen.items() if k != "model"}
        check("generation", out["generation"])
        if out["model"] is None:
            out["model"] = gen["model"]
    for key in PARTS:
        if out[key] is not None:
            check(key, out[key])
    if not any(out[k] is not None for k in PARTS) and not notices:
        raise ValueError(f"data: expected a dict with at least one of {', '.join(PARTS)} or notices, "
                         f"got {_got(data)}")
    out["notices"] = notices
    out["first"] = _first(data.get("first"), out)
    return out


def _first(first, out: dict):
    """``data["first"]`` checked: None, or one of :data:`FIRST` whose view the page has."""
    if first is None:
        return None
    if first not in FIRST or out.get(first) is None:
        have = [k for k in FIRST if out.get(k) is not None]
        raise ValueError(f"first: expected None or the view the page opens on, one of {', '.join(have) or 'none'} "
                         f"(those it has), got {first!r}")
    return first


# ---------------------------------------------------------------------------------------------- titles
# A title qkv itself gives (a built-in example's, :func:`qkv.explain.examples.titles`; the playground's default)
# travels in every language under the view's "titles"; the page shows it in its own language. A title the user
# gave has no "titles" and stays as written.
def words(key: str) -> dict:
    """One of qkv's own words (a :mod:`qkv.locales` key) in every language: a view's ``titles``."""
    from qkv import locales

    return {lang: locales.t(key, lang) for lang in locales.langs()}


def in_language(out: dict, lang: str) -> str:
    """The playground's title and the example view's name in ``lang`` where qkv gave them (their ``titles``), in
    :func:`normalize`'s ``out``; returns the page's own title (the browser tab's and the top heading's): with
    ``out["first"]`` the model and the input of the view it opens on (:func:`lead_title`)."""
    from qkv import locales

    for key, field in (("playground", "title"), ("example", "name")):
        view = out.get(key)
        if isinstance(view, dict) and isinstance(view.get("titles"), dict):
            out[key] = dict(view, **{field: str(view["titles"].get(lang) or view[field])})
    if out.get("first"):
        return lead_title(out, lang)
    return ((out.get("playground") or {}).get("title") or (out.get("example") or {}).get("name")
            or locales.t("page.doc_title", lang))


#: The most characters of the input a page title shows (then "…").
TITLE_INPUT_CHARS = 60


def lead_title(out: dict, lang: str) -> str:
    """The title of a page that opens on ``out["first"]``: its model and its input, e.g. "tiny-llama · the cat
    sat" (the prompt for a generation; both models for a comparison), the input on one line, cut at
    :data:`TITLE_INPUT_CHARS` characters."""
    from qkv import locales

    view = out[out["first"]]
    text = view["prompt"] if out["first"] == "generation" else view.get("text") or view.get("source") or ""
    text = " ".join(str(text).split())
    if len(text) > TITLE_INPUT_CHARS:
        text = text[:TITLE_INPUT_CHARS - 1] + "…"
    if out["first"] == "compare":
        return locales.t("page.title_compare", lang, a=view["name"], b=view["name_b"], text=text)
    return locales.t("page.title_model", lang, name=view["name"], text=text)
