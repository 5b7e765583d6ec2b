"""The tests of tests/unit/test_locales.py that need Chromium through Playwright."""
import json

import pytest

from qkv.explain import examples as ex


_ZH_PAGE_SCRIPT = r"""
import json, sys
from playwright.sync_api import sync_playwright
errors, requests, got = [], [], {}
with sync_playwright() as p:
    b = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--headless", "--no-sandbox", "--disable-gpu"])
    page = b.new_page()
    page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(sys.argv[1])
    page.wait_for_selector("body[data-ready='true']")
    got["lang"] = page.evaluate("document.documentElement.lang")
    got["reset"] = page.get_by_test_id("reset").text_content()
    got["h2"] = page.locator("#playground > h2").text_content()
    got["head_note"] = page.get_by_test_id("head-note").text_content()
    got["footer"] = page.locator("footer").text_content()
    page.get_by_test_id("X-0-0").fill("abc")
    got["status"] = page.get_by_test_id("status").text_content()
    b.close()
print(json.dumps({"errors": errors, "requests": requests, "got": got}, ensure_ascii=False))
"""


@pytest.mark.browser
def test_the_chinese_page_in_a_browser(tmp_path):
    """The zh page in Chromium: its words are Chinese, it stays offline and quiet (own process: the browser
    tests may hold Playwright's sync API in this one)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("playwright.sync_api")
    from qkv import viz

    if not os.path.exists("/usr/bin/chromium"):
        pytest.skip("no Chromium (tests/integration/browser fails instead; this is an extra)")
    path = tmp_path / "zh.html"
    viz.write_page(path, {"playground": viz.from_worked(ex.load_example("two_head"))}, lang="zh")
    p = subprocess.run([sys.executable, "-c", _ZH_PAGE_SCRIPT, path.as_uri()], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    got = res["got"]
    assert got["lang"] == "zh" and got["reset"] == "重置" and got["h2"] == "演练场"
    assert got["head_note"].startswith("头 0 使用 Q 和 K 的第 0–1 列")
    assert "离线" in got["footer"] and "不是数字" in got["status"]
    assert res["errors"] == [] and all(u.startswith(("file:", "data:")) for u in res["requests"])
