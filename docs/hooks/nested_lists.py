"""mkdocs hook: nested lists written for GitHub (two spaces a level) render nested on the site.

The pages are the README's sections, written for GitHub's renderer, which nests a list item
indented by two spaces. Python-Markdown nests only at four and flattens the rest, so this
doubles the indentation of every indented line that belongs to a list, outside code fences.
The sources stay as GitHub reads them."""

from __future__ import annotations

import re

ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.) ")


def on_page_markdown(markdown, page, config, files):
    return double_list_indents(markdown)


def double_list_indents(text: str) -> str:
    out, fence, in_list = [], False, False
    for line in text.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        elif not fence and line.strip():
            if not line.startswith(" "):
                in_list = bool(ITEM.match(line))  # a top-level item starts a list; text ends it
            elif in_list:
                spaces = len(line) - len(line.lstrip(" "))
                line = " " * (2 * spaces) + line.lstrip(" ")
        out.append(line)
    return "\n".join(out)
