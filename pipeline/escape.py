"""Text we emit into another format goes out through that format's escaper, one per format.

A model card (pipeline/model_card.py) interpolates values that come from outside the code:
directory names (``--out``, ``release.output``), ``tokenize.inputs``, task names from a detail
file, dataset names from a task-data config. Pasted raw, a name holding ``"),__import__(...`` turns
the card's ``from_pretrained(...)`` line into a command, and one holding a newline or ``<img
onerror=...>`` adds headings or live HTML to the rendered page. Each function here turns a value
into text that the target format reads back as that same value and nothing else.
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from pipeline.errors import PipelineError

# Characters a markdown renderer reads as syntax in the middle of a line: emphasis, code spans,
# links and images (no link without "["), table cells, strikethrough, the escape itself. Those
# that act only at the start of a line (#, -, +, 1.) cannot: a value never starts one. An
# underscore between two letters or digits (arc_easy) starts no emphasis and stays as it is.
_MARKDOWN_SYNTAX = set("\\`*_[]|~")
_HTML = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
# Every line break str.splitlines() knows: one of them in a value would start a new markdown line.
_LINE_BREAKS = set("\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")


# Written as \x.. escapes inside a Python literal: a backtick run could close a markdown code
# fence, and HTML metacharacters have no business in a page even inside one.
_PYTHON_HEX = {ch: f"\\x{ord(ch):02x}" for ch in "`<>&"}


def python_literal(value: Any) -> str:
    """``value`` as a Python string literal (``repr``, which escapes quotes, backslashes and line
    breaks) that reads back as ``value`` and is safe inside a markdown code fence."""
    return "".join(_PYTHON_HEX.get(ch, ch) for ch in repr(str(value)))


def markdown_text(value: Any) -> str:
    """``value`` as inline markdown that renders as exactly its text, on one line: HTML
    metacharacters as entities, markdown syntax backslash-escaped, line breaks as spaces (a value
    can start no heading, list, table row or front-matter line)."""
    text = str(value)
    out = []
    for i, ch in enumerate(text):
        if ch in _LINE_BREAKS:
            out.append(" ")
        elif ch in _HTML:
            out.append(_HTML[ch])
        elif ch == "_" and _between_alphanumerics(text, i):
            out.append(ch)
        elif ch in _MARKDOWN_SYNTAX:
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(" ")  # other control characters: nothing a reader should receive
        else:
            out.append(ch)
    return "".join(out)


def _between_alphanumerics(text: str, i: int) -> bool:
    return 0 < i < len(text) - 1 and text[i - 1].isalnum() and text[i + 1].isalnum()


def markdown_number(value: Any, spec: str = "") -> str:
    """A number formatted with ``spec`` (``.4f``); anything that is not a finite number is text."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
        return markdown_text(value)
    return format(value, spec)


def yaml_front_matter(mapping: dict[str, Any]) -> str:
    """``mapping`` as a markdown file's YAML header (``---`` lines around it) that loads back as
    exactly ``mapping``."""
    body = _dump(mapping)
    if _dump(yaml.safe_load(body)) != body or any(line.startswith(("---", "...")) for line in body.splitlines()):
        raise PipelineError("model card: a value of its YAML header does not read back as itself; refusing to write the card")
    return f"---\n{body}---\n"


def _dump(mapping: Any) -> str:
    """safe_dump indents every continuation line of a multi-line string: none can be ``---``."""
    return yaml.safe_dump(mapping, sort_keys=False, allow_unicode=True, width=float("inf"))
