"""qkv._files.atomic_write: the one way qkv writes a file (pictures, pages, lab plots) — whole or not at all."""
import os

import pytest

from qkv._files import atomic_write


def _umask_mode():
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def test_a_failed_write_leaves_nothing_and_keeps_the_old_file(tmp_path):
    new = tmp_path / "new.bin"
    with pytest.raises(MemoryError):
        with atomic_write(new) as fh:
            fh.write(b"half")
            raise MemoryError
    assert list(tmp_path.iterdir()) == []
    old = tmp_path / "old.txt"
    old.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(old, "w", encoding="utf-8") as fh:
            fh.write("new")
            raise KeyboardInterrupt
    assert old.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["old.txt"]


def test_the_new_file_gets_the_usual_permissions_not_mkstemps(tmp_path):
    p = tmp_path / "a.txt"
    with atomic_write(p, "w", encoding="utf-8") as fh:
        fh.write("你好")
    assert p.read_text(encoding="utf-8") == "你好" and p.stat().st_mode & 0o777 == _umask_mode()
    os.chmod(p, 0o640)
    with atomic_write(p, "w", encoding="utf-8") as fh:
        fh.write("again")
    assert p.read_text() == "again" and p.stat().st_mode & 0o777 == 0o640       # the replaced file's


def test_every_writer_goes_through_it(tmp_path, monkeypatch):
    # the page, the heatmap and the lab's plots: each calls the one helper (counted) and gets its permissions
    import importlib

    import qkv._files as files
    heatmap, page, lab_plots = (importlib.import_module(m) for m in ("qkv.viz.heatmap", "qkv.viz.page",
                                                                        "qkv.viz.lab_plots"))
    calls = []
    real = files.atomic_write

    def counting(path, *a, **kw):
        calls.append(os.path.basename(path))
        return real(path, *a, **kw)
    for mod in (heatmap, page, lab_plots):
        monkeypatch.setattr(mod, "atomic_write", counting)
    page.write_page(tmp_path / "p.html", {"notices": [{"key": "page.playground_too_big", "args": {"cells": 9, "limit": 4}}]})
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = plt.figure()
    lab_plots.save_atomic(fig, tmp_path / "lab.png")
    heatmap.save(fig, tmp_path / "h.svg")
    plt.close(fig)
    assert calls == ["p.html", "lab.png", "h.svg"]
    for name in calls:
        assert (tmp_path / name).stat().st_mode & 0o777 == _umask_mode()
