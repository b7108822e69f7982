"""The default run's numbers the README prints are `make repro`'s own (issue 51). After a
`make repro` in the checkout, ``MOE_REGENERATE_NUMBERS=1 pytest tests/test_default_numbers.py``
writes its metrics/eval.json into the README's block; without that variable the test compares
them (when the checkout holds a run of the default), and always checks that the block is a run
of today's default evaluation (its tasks, documents and step), so a changed default cannot keep
stale numbers."""

import json
import os
import re

from tests.workspace import REPO

README = REPO / "README.md"
BLOCK = re.compile(r"(<!-- the default run's metrics/eval\.json -->\n```json\n)(.*?)(```)", re.S)


def render(summary: dict) -> str:
    """metrics/eval.json as the README shows it: its figures rounded to what a reader compares."""

    def short(key: str, value):
        if isinstance(value, dict):
            return {k: short(k, v) for k, v in value.items()}
        if isinstance(value, float) and not value.is_integer():
            return round(value, 2 if key.endswith("perplexity") else 4)
        return value

    return json.dumps(short("", summary), indent=1) + "\n"


def _default():
    from pipeline.eval.tasks import resolve_tasks
    from pipeline.params import load_params

    cfg = load_params(REPO / "params.yaml", [])
    return cfg, resolve_tasks(cfg.evaluate.tasks, "evaluate.tasks")


def test_the_readme_prints_the_default_run_s_numbers():
    text = README.read_text()
    found = BLOCK.search(text)
    assert found, "README.md: no block of the default run's metrics/eval.json"
    cfg, tasks = _default()
    made = REPO / cfg.evaluate.output
    if made.is_file():
        summary = json.loads(made.read_text())
        if summary.get("step") == cfg.train.max_steps and summary["suite"].get("tasks") == len(tasks):  # a run of the default
            if os.environ.get("MOE_REGENERATE_NUMBERS"):
                README.write_text(text[: found.start(2)] + render(summary) + text[found.end(2) :])
                found = BLOCK.search(README.read_text())
            assert found.group(2) == render(summary), "README.md: not the last `make repro`'s numbers (MOE_REGENERATE_NUMBERS=1 rewrites them)"
    shown = json.loads(found.group(2))
    suite = shown["suite"]
    assert shown["step"] == cfg.train.max_steps and suite["tasks"] == len(tasks)
    assert suite["docs"] == len(tasks) * cfg.evaluate.limit
    assert "truncated_docs" not in suite and "dropped_docs" not in suite  # the default cuts no context
