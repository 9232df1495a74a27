"""The documentation site and the README: `mkdocs build --strict` passes (a broken link, a
missing anchor or a name mkdocstrings cannot resolve fails it), every public name has its API
entry, every committed bench result is rendered, and the README stays short and its example
runs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
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
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # see mkdocs.yml
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


def test_the_char_lm_recipe_shows_the_code_the_job_runs(site):
    html = (site / "howto" / "char-lm" / "index.html").read_text()
    text = re.sub(r"<[^>]+>", "", html)  # highlighted code: one span a token
    assert "def windows(texts, seq_len" in text and "char_lm.windows(texts, args.seq_len" in text


def test_the_guide_draws_its_flows_as_diagrams(site):
    """Mermaid blocks, which the site renders at the page's width (mermaid.js, from a CDN
    when read), not box-drawing text in code blocks, which a page cuts off."""
    html = (site / "guide" / "sync-async" / "index.html").read_text()
    assert html.count('<pre class="mermaid"><code>flowchart') == 2  # sync and async
    for page in (site / "guide").rglob("index.html"):
        assert not re.search("[└├│]|──", page.read_text()), page


def test_the_readme_is_short_and_links_into_the_site():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(((?:docs/|ARCHITECTURE)[^)#]*)", text)
    assert links and all((ROOT / link).is_file() for link in links), links


def readme_example() -> str:
    section = README.read_text().split("## A complete example", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture(scope="module")
def readme_run(spark):
    """The README example run once, as it is: its namespace and what it printed."""
    namespace, printed = {"__name__": "readme_example"}, io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(readme_example(), "README.md", "exec"), namespace)
    return namespace, printed.getvalue()


@pytest.mark.spark
def test_the_readme_example_runs_and_learns(readme_run):
    namespace, printed = readme_run
    result = namespace["result"]
    assert result.history[-1]["eval_accuracy"] > 0.85  # a linear rule: the MLP learns it
    assert namespace["scored"].count() == namespace["test_df"].count()
    assert "test accuracy" in printed


class _Article(HTMLParser):
    """A built page's content as a reader meets it: its text and hover titles, and under
    each API entry (`id="sparkdl_avg..."`) its `<code>` items, by list item."""

    def __init__(self) -> None:
        super().__init__()
        self.depth, self.text, self.titles = 0, [], []
        self.entry, self.heading, self.label, self.code = "", None, None, None
        self.pre = 0
        self.codes: dict[str, dict[str, list[str]]] = {}
        """entry id -> list item's label (its text before its first code; "" outside any
        list item) -> the code items in it."""

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.depth += tag == "article"
        if not self.depth:
            return
        if attrs.get("title"):
            self.titles.append(attrs["title"])
        if (attrs.get("id") or "").startswith("sparkdl_avg."):
            self.entry, self.heading = attrs["id"], tag  # its heading's codes are not its own
        if tag == "li":
            self.label = ""
        self.pre += tag == "pre"  # a signature or an example, not a name in the text
        if tag == "code" and self.heading is None and not self.pre:
            self.code = ""

    def handle_endtag(self, tag):
        if not self.depth:
            return
        self.depth -= tag == "article"
        if tag == self.heading:
            self.heading = None
        self.pre -= tag == "pre"
        if tag == "code" and self.code is not None:
            label = "" if self.label is None else self.label.strip()
            self.codes.setdefault(self.entry, {}).setdefault(label, []).append(self.code)
            self.code = None
            if self.label is not None:
                self.label = " " + self.label  # marks the label complete (see handle_data)
        if tag == "li":
            self.label = None

    def handle_data(self, data):
        if not self.depth:
            return
        self.text.append(data)
        if self.code is not None:
            self.code += data
        elif self.label is not None and not self.label.startswith(" "):
            self.label += data


def read_article(path: Path) -> _Article:
    article = _Article()
    article.feed(path.read_text())
    return article


PRIVATE = re.compile(r"(?<![\w.])_[A-Za-z]\w*|\w+(?:\.\w+)*\._[A-Za-z]\w*")
"""A private name (`_BuiltOnRequest`, `_model_output.model_head`) or a path through one
(`sparkdl_avg._errors.DataError`); `__version__` is neither."""


def test_the_reference_shows_no_private_name(site):
    for page in sorted((site / "reference").rglob("index.html")):
        article = read_article(page)
        shown = "".join(article.text) + "\n" + "\n".join(article.titles)
        assert article.text and not PRIVATE.findall(shown), (page, PRIVATE.findall(shown))


def key_documented(key: str, documented) -> bool:
    """`key` is one of `documented`, or matches a pattern there (refused_<reason>)."""
    return any(key == d or ("<" in d and key.startswith(d.split("<")[0])) for d in documented)


@pytest.mark.spark
def test_the_reference_names_the_keys_a_fit_returns(readme_run, site):
    """The README's fit (sync, cross_entropy, eval_df, the model logged) against FitResult's
    reference page: every key of its workers and timings, and its history rows' keys by
    the list item that says when a row has them."""
    result = readme_run[0]["result"]
    codes = read_article(site / "reference" / "fit" / "index.html").codes
    workers = [k for keys in codes["sparkdl_avg.FitResult.workers"].values() for k in keys]
    returned = {k for w in result.workers for k in w}
    assert returned == set(workers), returned ^ set(workers)
    timings = set(codes["sparkdl_avg.FitResult.timings"][""])
    assert set(result.timings) == timings, set(result.timings) ^ timings
    history = codes["sparkdl_avg.FitResult.history"]
    every = history["sync, every training round:"]
    evaluated = [k for k in history["sync, a round that evaluates eval_df (round 0 "
                                    "included): also"]
                 if k.isidentifier()]  # not a pattern (eval_<name>) or fit(metrics=)
    allowed = [k for label, keys in history.items() if label.startswith(("sync", "both"))
               for k in keys]
    assert any("eval_loss" in row for row in result.history)
    assert result.history[0]["round"] == 0 and "train_loss" not in result.history[0]
    for row in result.history:
        if row["round"] > 0:  # round 0: the evaluation before training alone
            assert set(every) <= set(row), set(every) - set(row)
        assert "eval_loss" not in row or set(evaluated) <= set(row), set(evaluated) - set(row)
        assert all(key_documented(k, allowed) for k in row), \
            [k for k in row if not key_documented(k, allowed)]


def test_nested_lists_written_for_github_nest_on_the_site():
    import importlib.util

    spec = importlib.util.spec_from_file_location("nested_lists",
                                                  ROOT / "docs" / "hooks" / "nested_lists.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    text = "- a\n  more\n  - b\n    more\n\n  after\n```\n  code\n```\ntext\n  lazy\n"
    assert hook.double_list_indents(text) == (
        "- a\n    more\n    - b\n        more\n\n    after\n```\n  code\n```\ntext\n  lazy\n")
