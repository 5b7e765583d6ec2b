"""The long-input page (issue 41): `qkv view --hf DIR --text-file FILE --rows 0,N/2,-1` on a tiny random Llama
(hidden 64, 2 layers, 4 heads, max_position_embeddings 32,768, saved with save_pretrained) at 32,768 tokens.

Prints the page's size, its first paint in Chromium (Playwright: ``performance.getEntriesByType('paint')``, and
the page's own "every view drawn" mark), the command's peak memory (the child's peak RSS, from
``resource.getrusage(RUSAGE_CHILDREN)``) and its wall time. The bounds of the issue: page ≤ 30 MB, first paint
≤ 2 s, peak memory ≤ 2 GB; N² weights (4 GiB per head at this length) are never held.

    .venv/bin/python benchmarks/bench_long_page.py [--tokens 32768] [--rows 0,16384,-1] [--keep DIR]

Not part of the tests (minutes on 2 cores). Results: benchmarks/RESULTS.md, "Long-input page (issue 41)".
"""
from __future__ import annotations

import argparse
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

WORDS = "[PAD] [UNK] the cat sat on mat and it was tired because animal didn't cross street".split()
CHROMIUM = "/usr/bin/chromium"


def make_folder(path: pathlib.Path, context: int) -> None:
    """A tiny random Llama (hidden 64, 2 layers, 4 heads) and a word-level tokenizer, saved with save_pretrained."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=context)
    LlamaForCausalLM(cfg).save_pretrained(path)
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(path)


def make_text(path: pathlib.Path, tokens: int) -> None:
    """``tokens`` words of the vocabulary (one token each), seeded."""
    import numpy as np

    rng = np.random.default_rng(0)
    words = WORDS[2:]
    path.write_text(" ".join(words[i] for i in rng.integers(0, len(words), tokens)), encoding="utf-8")


def run_cli(folder, text, rows: str, page) -> tuple[float, int]:
    """``qkv view`` in a child process: (wall seconds, the child's peak RSS in bytes)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    qkv = pathlib.Path(sys.executable).with_name("qkv")
    done = subprocess.run([str(qkv), "view", "--hf", str(folder), "--text-file", str(text), "--rows", rows,
                           "-o", str(page)], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"qkv view failed ({done.returncode}): {done.stderr.strip()}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:
        print("note: the child's peak RSS did not exceed an earlier child's; the figure is an upper bound")
    return wall, peak * 1024                                           # ru_maxrss is in KiB on Linux


def first_paint(page) -> tuple[float, float]:
    """(first-contentful-paint ms, the page's data-ready ms) of ``page`` opened from disk in Chromium, offline."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        ctx = browser.new_context(viewport={"width": 1280, "height": 900})
        ctx.route("**/*", lambda r: r.continue_() if r.request.url.startswith(("file:", "data:")) else r.abort())
        pg = ctx.new_page()
        pg.goto(pathlib.Path(page).resolve().as_uri())
        pg.wait_for_selector("body[data-ready='true']", timeout=120_000)
        paints = pg.evaluate("Object.fromEntries(performance.getEntriesByType('paint')"
                             ".map(e => [e.name, e.startTime]))")
        ready = float(pg.get_attribute("body", "data-ready-ms"))
        browser.close()
    return float(paints.get("first-contentful-paint", paints.get("first-paint", float("nan")))), ready


def breakdown(folder, text, rows: str) -> str:
    """In this process: the forward pass alone on qkv, then with the summaries and rows recorded, then the page
    written (qkv.viz.long_data + write_page), in seconds."""
    import numpy as np

    import qkv.hf
    from qkv import viz
    from qkv.viz.page_long import check_rows, encode, record_long

    model = qkv.hf.load(folder)
    content = pathlib.Path(text).read_text(encoding="utf-8")
    ids, tokens = encode(model, content)
    t0 = time.perf_counter()
    model._forward(ids[None], np.ones((1, len(ids)), bool), None)
    t1 = time.perf_counter()
    record_long(model, ids, tokens, check_rows([int(r) for r in rows.split(",")], len(ids)))
    t2 = time.perf_counter()
    data = {"long": viz.long_data(model, content, rows=[int(r) for r in rows.split(",")]), "first": "long"}
    t3 = time.perf_counter()
    viz.render_page(data)
    t4 = time.perf_counter()
    return (f"forward alone {t1 - t0:.1f} s; forward + summaries + rows {t2 - t1:.1f} s; long_data (that again, "
            f"and the maps coded) {t3 - t2:.1f} s; render_page {t4 - t3:.1f} s")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32_768)
    ap.add_argument("--rows", default=None, help="default 0,N/2,-1")
    ap.add_argument("--keep", default=None, help="a folder to keep the model, text and page in")
    ap.add_argument("--breakdown", action="store_true", help="also time the parts in this process")
    args = ap.parse_args(argv)
    rows = args.rows or f"0,{args.tokens // 2},-1"
    with tempfile.TemporaryDirectory() as tmp:
        where = pathlib.Path(args.keep or tmp)
        where.mkdir(parents=True, exist_ok=True)
        folder, text, page = where / "tiny-llama", where / "long.txt", where / "long.html"
        if not (folder / "config.json").exists():
            make_folder(folder, max(32_768, args.tokens))
        make_text(text, args.tokens)
        wall, peak = run_cli(folder, text, rows, page)
        size = os.path.getsize(page)
        fcp, ready = first_paint(page)
        print(f"tokens {args.tokens:,}, rows {rows}: qkv view {wall:.1f} s, peak RSS {peak / 1e9:.2f} GB, "
              f"page {size / 1e6:.2f} MB, first contentful paint {fcp:.0f} ms, every view drawn {ready:.0f} ms")
        print(f"bounds: page ≤ 30 MB {'ok' if size <= 30e6 else 'OVER'}, first paint ≤ 2 s "
              f"{'ok' if fcp <= 2000 else 'OVER'}, peak ≤ 2 GB {'ok' if peak <= 2e9 else 'OVER'}")
        if args.breakdown:
            print(breakdown(folder, text, rows))


if __name__ == "__main__":
    main()
