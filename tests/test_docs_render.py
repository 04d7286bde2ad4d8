"""The pages render as written: Python-Markdown, with the extensions of ``mkdocs.yml``, keeps
every list a list and every fenced block a code block.

Python-Markdown is stricter than GitHub's renderer: a list needs a blank line after a paragraph,
a nested list or a second paragraph of an item is indented by four spaces, an item that follows
a multi-paragraph item needs a blank line before it, and a fence inside a list item needs
``pymdownx.superfences``. Broken, the page shows ``- **text**`` as a paragraph and a code block
as one line of inline code; ``mkdocs build --strict`` does not see it.
"""

from __future__ import annotations

import re
from pathlib import Path

import markdown
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```(\w+)\s*$", re.MULTILINE)
LIST_LINE = re.compile(r"^\s*(?:[-*]|\d+\.) \S", re.MULTILINE)


def _extensions() -> list[str]:
    """The Markdown extensions `mkdocs.yml` names, without their settings (snippets' paths)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return [
        next(iter(entry)) if isinstance(entry, dict) else entry
        for entry in config["markdown_extensions"]
    ]


def _render(text: str) -> str:
    # mkdocs always adds toc, tables and fenced_code; Pygments off, so that a fenced block is
    # marked with its language
    extensions = ["toc", "tables", "fenced_code", "pymdownx.highlight", *_extensions()]
    configs = {"pymdownx.highlight": {"use_pygments": False}}
    return markdown.markdown(text, extensions=extensions, extension_configs=configs)


def _paragraphs(html: str) -> list[str]:
    return re.findall(r"<p>(.*?)</p>", html, flags=re.DOTALL)


@pytest.mark.parametrize("page", PAGES)
def test_no_list_is_rendered_as_a_paragraph(page):
    html = _render((ROOT / page).read_text())
    swallowed = [p[:80] for p in _paragraphs(html) if LIST_LINE.search(p)]
    assert not swallowed, f"{page}: list items rendered as text: {swallowed}"


@pytest.mark.parametrize("page", PAGES)
def test_every_fenced_block_is_a_code_block(page):
    text = (ROOT / page).read_text()
    html = _render(text)
    rendered = re.findall(r'<code class="language-(\w+)"', html)
    assert sorted(rendered) == sorted(FENCE.findall(text)), page


def test_the_checks_see_the_two_failures():
    # a list straight after a paragraph, and a fence inside an item whose next item has no
    # blank line before it: both render wrong, and the checks above say so
    broken = "Reading.\n- **a** one\n- b\n\n- item\n\n    ```python\n    x = 1\n    ```\n- next\n"
    html = _render(broken)
    assert any(LIST_LINE.search(p) for p in _paragraphs(html))
    fixed = (
        "Reading.\n\n- **a** one\n- b\n\n- item\n\n    ```python\n    x = 1\n    ```\n\n- next\n"
    )
    html = _render(fixed)
    assert not any(LIST_LINE.search(p) for p in _paragraphs(html))
    assert re.findall(r'<code class="language-(\w+)"', html) == ["python"]
