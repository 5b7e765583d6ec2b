"""`qkv` and `qkv lab` with no command print their help as --help does, on stdout (issue 26)."""
import pytest

pytest.importorskip("click")

from qkv.cli import main  # noqa: E402


@pytest.mark.parametrize("args", [[], ["lab"]])
def test_no_command_prints_the_help(capsys, args):
    rc = main(args)
    out, err = capsys.readouterr()
    assert rc == 0 and err == ""
    assert main(args + ["--help"]) == 0
    assert out == capsys.readouterr().out and out.startswith("Usage: qkv") and out.count("\n") > 5
