"""A progress bar for the command line's long runs: tqdm on stderr, shown only on a terminal and only once a
run has taken a second (a short run, or output piped to a file, shows nothing)."""
from __future__ import annotations

import contextlib
import shutil
import sys


@contextlib.contextmanager
def progress_bar(desc: str, total: int, unit: str):
    """Yields ``update(n)`` for a bar of ``total`` units (a no-op where tqdm is missing)."""
    try:
        from tqdm import tqdm
    except ImportError:                                    # pragma: no cover - tqdm comes with the cli extra
        yield lambda n=1: None
        return
    cols = shutil.get_terminal_size((80, 24)).columns or 80      # a terminal of no size (a bare pty) says 0
    with tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None, delay=1.0, leave=False,
              ncols=min(cols, 100)) as bar:
        yield bar.update
