"""What the CLI tests check of a command: its exit code and output, and that bad input is one line on stderr."""
import re

from qkv.cli import main


def run(capsys, *args):
    """``qkv ARGS`` in this process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(code, err, pattern=None):
    """Bad input's contract: exit code 2, one line on stderr starting with ``qkv``, no traceback (and the line
    matching ``pattern``)."""
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("qkv") and "Traceback" not in err, err
    if pattern:
        assert re.search(pattern, err), err
