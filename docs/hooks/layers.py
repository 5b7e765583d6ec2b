"""mkdocs hook: the architecture page's list of layers, written from pyproject.toml's import-linter contracts.

The page holds the marker ``<!-- layers -->``; at build time it becomes one fenced block per layers contract
(the top-level folders, then inside each folder), each layer with the comment written above it in the
contract. The list cannot drift from what ``lint-imports`` checks: it is read from the same text.
"""
from __future__ import annotations

import re
from pathlib import Path

MARKER = "<!-- layers -->"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def contracts(text: str) -> list[dict]:
    """Every layers contract: name, container (or None) and its layers top down, each (names, comment)."""
    out = []
    for block in text.split("[[tool.importlinter.contracts]]")[1:]:
        if 'type = "layers"' not in block:
            continue
        name = re.search(r'^name = "([^"]+)"', block, re.M).group(1)
        container = re.search(r'^containers = \["([^"]+)"\]', block, re.M)
        body = re.search(r"^layers = \[(.*?)^\]", block, re.M | re.S).group(1)
        layers, comment = [], []
        for line in body.splitlines():
            line = line.strip()
            if line.startswith("#"):
                comment.append(line.lstrip("# "))
            elif line.startswith('"'):
                names = [n.strip() for n in line.strip('",').split("|")]
                layers.append((names, " ".join(comment)))
                comment = []
        out.append({"name": name, "container": container and container.group(1), "layers": layers})
    return out


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + [line] if line else lines


def render(text: str) -> str:
    """The markdown that replaces the marker."""
    parts = []
    for c in contracts(text):
        prefix = (c["container"] + ".") if c["container"] else ""
        title = f"Inside `{c['container']}`" if c["container"] else "The folders"
        rows = []
        for names, comment in c["layers"]:
            label = ", ".join(n.removeprefix("qkv.").removeprefix(prefix) for n in names)
            body = _wrap(comment, 80) or [""]
            if len(label) >= 30:                 # a long name column: the text starts on the next line
                rows.append(label)
                body_rows = body
            else:
                rows.append(f"{label:<30}{body[0]}".rstrip())
                body_rows = body[1:]
            rows += [" " * 30 + b for b in body_rows]
        parts.append(f"**{title}** — {c['name']}:\n\n```\n" + "\n".join(rows) + "\n```\n")
    return "\n".join(parts)


def on_page_markdown(markdown, page, config, files):
    if MARKER in markdown:
        return markdown.replace(MARKER, render(PYPROJECT.read_text(encoding="utf-8")))
    return markdown
