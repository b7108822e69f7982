"""pipeline.escape: each format's escaper reads back as exactly the value, and nothing else
(issue 50: names pasted into the model card ran code, added headings and live HTML)."""

import ast
import re

import pytest
import yaml

from pipeline.escape import markdown_number, markdown_text, python_literal, yaml_front_matter

# What the audit put into the card's fields (directory names, tokenize.inputs, task names, task data).
PAYLOADS = [
    'm"),__import__("os").system("id"),("',
    "m'),__import__('os').system('id'),('",
    "<img src=x onerror=alert(1)>",
    "corpus\n# Injected heading\n<img src=x onerror=alert(1)>",
    "x\r\n---\ninjected: true\n---",
    "```\nimport os; os.system('id')\n```",
    "[click](javascript:alert(1)) ![i](http://x/y.png)",
    "| a | b |\n|---|---|",
    "back\\slash `code` *bold* _em_ ~~strike~~ &amp; \u2028# after a line separator",
]


@pytest.mark.parametrize("value", PAYLOADS)
def test_a_python_literal_is_one_string_constant_of_the_value(value):
    literal = python_literal(value)
    tree = ast.parse(f"f({literal})", mode="eval")
    (arg,) = tree.body.args
    assert isinstance(arg, ast.Constant) and arg.value == value
    assert "\n" not in literal and "`" not in literal and "<" not in literal


@pytest.mark.parametrize("value", PAYLOADS)
def test_markdown_text_is_one_line_with_no_html_or_markdown_syntax_left(value):
    text = markdown_text(value)
    assert len(text.splitlines()) <= 1 and "<" not in text and ">" not in text
    for ch in "`*[]|~":  # each one escaped
        assert text.count(ch) == text.count("\\" + ch)
    bare = text.replace("\\_", "")
    assert re.search(r"(?<![^\W_])_|_(?![^\W_])", bare) is None  # an underscore that could open or close emphasis: escaped


def test_markdown_text_leaves_plain_names_alone():
    assert markdown_text("allenai/OLMoE-1B-7B-0924 (v2.1)") == "allenai/OLMoE-1B-7B-0924 (v2.1)"
    assert markdown_text("mmlu_stem_mc_5shot") == "mmlu_stem_mc_5shot"  # an underscore inside a word emphasises nothing
    assert markdown_text("_em_ x_ __init__") == "\\_em\\_ x\\_ \\_\\_init\\_\\_"
    assert markdown_number(0.25, ".4f") == "0.2500" and markdown_number(float("nan"), ".4f") == "nan"
    assert markdown_number("<b>", ".4f") == "&lt;b&gt;"


def test_yaml_front_matter_reads_back_as_the_mapping_and_holds_no_marker_line():
    header = {"model-index": [{"name": v, "results": [{"dataset": {"name": v, "type": v}}]} for v in PAYLOADS]}
    text = yaml_front_matter(header)
    lines = text.splitlines()
    assert lines[0] == "---" and lines[-1] == "---" and "---" not in lines[1:-1]
    assert yaml.safe_load(text.split("---\n")[1]) == header
    assert all(not line.startswith(("---", "...", "#")) for line in lines[1:-1])
