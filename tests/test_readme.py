"""Every command the README and docs/ show runs as written: here, in a trained workspace (slow,
tests/pipeline/test_dvc_e2e.py), or where it needs what this machine lacks (a GPU, a Slurm
job, a container builder), with the test that covers it named. A new command must be added to
one of these lists. The README is a short map: every page under docs/ is linked from it, and
every link of the README and the pages leads somewhere that exists."""

import os
import re
import shlex
import subprocess

import pytest

from tests.readme_commands import DOCS, ELSEWHERE, GPU, HERE, REPO, WORKSPACE, argv, links, page_commands, pages, readme_commands

README = REPO / "README.md"
MAX_README_WORDS = 1500


def test_every_readme_command_is_accounted_for():
    found = readme_commands()
    known = HERE | GPU | set(WORKSPACE) | set(ELSEWHERE)
    unknown = [f"{p.relative_to(REPO)}: {c}" for p in pages() for c in page_commands(p) if c not in known]
    assert not unknown, f"commands with no test: classify them in tests/readme_commands.py: {unknown}"
    assert not [c for c in known if c not in found], "stale entries: neither the README nor docs/ shows them"


def test_one_invocation_style_the_activated_environment():
    """`. .venv/bin/activate` once (the README says so), then bare `moe`, `dvc`, `python`."""
    styled = [c for c in readme_commands() if c.startswith((".venv/", "PATH=", "./.venv/"))]
    assert not styled, styled
    assert "`. .venv/bin/activate`" in README.read_text()


@pytest.mark.parametrize("cmd", sorted(HERE))
def test_readme_command_runs_here(cmd, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(argv(cmd), cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip()


@pytest.mark.parametrize("cmd", sorted(GPU))
def test_gpu_readme_command_parses(cmd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([*argv(cmd), "--help"], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage" in (r.stdout + r.stderr).lower()


def test_make_commands_name_targets_the_makefile_defines():
    """`make -n` (print, run nothing): each `make ...` shown is a target with the variables given."""
    shown = [c for c in readme_commands() if c.startswith("make ")]
    assert {"make repro", "make test"} <= set(shown)
    for cmd in shown:
        r = subprocess.run(["make", "-n", *shlex.split(cmd)[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (cmd, r.stderr[-2000:])


def test_the_readme_is_a_short_map():
    text = README.read_text()
    assert len(text.split()) < MAX_README_WORDS, f"README.md has {len(text.split())} words (`wc -w`)"
    head = text[: text.index("\n## ", text.index("## Two commands") + 1)]
    assert "make repro" in head and "make test" in head  # the two commands come first (.ci/run runs `make test`)
    assert "Supercharging Olmo-core for Efficient and Scalable MoE Training" in text
    assert "## Contents" in text


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / t.split("#", 1)[0]).resolve() for t in links(README) if not _external(t)}
    pages_ = sorted(DOCS.glob("*.md"))
    assert pages_, "docs/ holds no page"
    assert not [p.name for p in pages_ if p.resolve() not in linked], "docs pages the README does not link"


def test_every_readme_link_to_docs_exists():
    targets = [t.split("#", 1)[0] for t in links(README) if t.startswith("docs/")]
    assert targets
    assert not [t for t in targets if not (REPO / t).exists()]


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_links_lead_somewhere_that_exists(page):
    """Relative links resolve to a file or folder of the checkout, and an #anchor to a heading."""
    broken = []
    for target in links(page):
        if _external(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    assert not broken, broken


def test_commands_are_shown_in_bash_blocks_only():
    """A command in a block of another kind would escape these tests."""
    for page in pages():
        for lang, body in re.findall(r"^\s*```(\w*)\n(.*?)```", page.read_text(), flags=re.S | re.M):
            assert lang in ("bash", "json", "yaml", ""), (page.name, lang)
            if lang != "bash":
                first = body.lstrip().split(maxsplit=1)[0] if body.strip() else ""
                assert first not in ("moe", "dvc", "make", "python", "$"), (page.name, body[:80])


def _external(target: str) -> bool:
    return target.startswith(("http://", "https://", "mailto:"))


def _anchors(page) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_quickstart_s_plan_figures_are_the_plan_s():
    """The peaks the GPU quickstart quotes are what its `moe plan` command prints today, for its
    layout and for the same job with neither ep nor ZeRO-1 (a planner change updates the page)."""
    import json

    text = (DOCS / "gpu-quickstart.md").read_text()
    quoted = re.search(r"predicts a peak of ([\d.]+) GiB per H200 for this layout, against ([\d.]+) GiB of", text)
    assert quoted, "docs/gpu-quickstart.md: the sentence quoting the plan's peaks changed; update this test"
    (cmd,) = [c for c in page_commands(DOCS / "gpu-quickstart.md") if c.startswith("moe plan ")]
    plain = cmd.replace(" --set parallel.ep=8 --set parallel.shard_optimizer=true", "")
    assert plain != cmd
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for command, figure in ((cmd, quoted.group(1)), (plain, quoted.group(2))):
        out = subprocess.run([*argv(command), "--json"], cwd=REPO, capture_output=True, text=True, timeout=600, env=env, check=True)
        assert f"{json.loads(out.stdout)['peak_gib']:.1f}" == figure, command
