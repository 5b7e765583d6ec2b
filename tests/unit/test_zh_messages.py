"""qkv view answers in the page's language (issue 26): its worked-example errors are qkv explain's, in --lang."""
import pytest

pytest.importorskip("click")

from qkv.cli import main  # noqa: E402


@pytest.mark.parametrize("args, zh", [
    (["--example", "nosuch"], "--example：没有内置示例 'nosuch'；应为 seed003"),
    (["no/such/file.yaml"], "无法读取 'no/such/file.yaml'：没有这个文件"),
    (["--example", "seed003", "{tmp}"], "--example NAME 与 FILE 只能给一个"),
])
def test_view_says_what_is_wrong_in_chinese(tmp_path, capsys, args, zh):
    out = tmp_path / "v.html"
    rc = main(["view", *[a.replace("{tmp}", str(tmp_path / "x.yaml")) for a in args], "--lang", "zh", "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and zh in err, err
    assert not out.exists()
