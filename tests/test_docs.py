"""The documentation site and the README: `mkdocs build --strict` passes (a broken link, a
missing anchor or a name mkdocstrings cannot resolve fails it), every public name has its API
entry, every committed bench result is rendered, and the README stays short and its example
runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sparkdl_avg

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason="the docs extra (part of dev) is not installed")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # Material's notice
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_the_site_builds_strictly_with_every_page(site):
    pages = {p.relative_to(ROOT / "docs").with_suffix("").as_posix()
             for p in (ROOT / "docs").rglob("*.md")}
    for page in pages:  # each page rendered where mkdocs puts it
        html = site / ("index.html" if page == "index" else page.removesuffix("/index")
                       + "/index.html")
        assert html.is_file(), page


def test_every_public_name_has_an_api_entry(site):
    html = "".join(p.read_text() for p in (site / "reference").rglob("*.html"))
    missing = [name for name in sparkdl_avg.__all__ if f'id="sparkdl_avg.{name}"' not in html]
    assert not missing, f"no API entry for {missing}: add ::: sparkdl_avg.NAME to docs/reference"


def test_every_committed_bench_result_is_rendered_with_its_figures(site):
    html = (site / "benchmarks" / "results" / "index.html").read_text()
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        assert f'id="{path.stem}"' in html, path.name
        assert (site / "bench" / "results" / path.name).read_bytes() == path.read_bytes()
        command = json.loads(path.read_text()).get("command")
        assert command and command.split()[1] in html, path.name  # e.g. bench/first_step.py


def test_architecture_is_the_top_level_file_included(site):
    html = (site / "architecture" / "index.html").read_text()
    for heading in re.findall(r"^## (.+)$", (ROOT / "ARCHITECTURE.md").read_text(), re.M):
        assert heading in html, heading


def test_getting_started_includes_the_readme_example(site):
    html = (site / "getting-started" / "index.html").read_text()
    assert "randomSplit" in readme_example() and "randomSplit" in html


def test_the_readme_is_short_and_links_into_the_site():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(((?:docs/|ARCHITECTURE)[^)#]*)", text)
    assert links and all((ROOT / link).is_file() for link in links), links


def readme_example() -> str:
    section = README.read_text().split("## A complete example", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.spark
def test_the_readme_example_runs_and_learns(spark, capsys):
    namespace = {"__name__": "readme_example"}
    exec(compile(readme_example(), "README.md", "exec"), namespace)
    result = namespace["result"]
    assert result.history[-1]["eval_accuracy"] > 0.85  # a linear rule: the MLP learns it
    assert namespace["scored"].count() == namespace["test_df"].count()
    assert "test accuracy" in capsys.readouterr().out


def test_nested_lists_written_for_github_nest_on_the_site():
    import importlib.util

    spec = importlib.util.spec_from_file_location("nested_lists",
                                                  ROOT / "docs" / "hooks" / "nested_lists.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    text = "- a\n  more\n  - b\n    more\n\n  after\n```\n  code\n```\ntext\n  lazy\n"
    assert hook.double_list_indents(text) == (
        "- a\n    more\n    - b\n        more\n\n    after\n```\n  code\n```\ntext\n  lazy\n")
