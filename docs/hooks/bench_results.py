"""mkdocs hook: the committed bench results (bench/results/*.json) as pages of the site.

Each JSON file that `bench/_common.report` wrote becomes a section of benchmarks/results.md
(where it says `<!-- bench-results -->`): the command, when and where it ran, and its figures
as a table; the raw file is copied into the site beside it. So the site never quotes a figure
that no committed file holds, and a new result needs no edit here."""

from __future__ import annotations

import json
from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
MARKER = "<!-- bench-results -->"
PAGE = "benchmarks/results.md"
MAX_LIST = 12  # longer lists (per-run samples, timelines) are cut in the table, whole in the JSON


def on_files(files, config):
    for path in sorted(RESULTS.glob("*.json")):
        files.append(File.generated(config, f"bench/results/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != PAGE:
        return markdown
    sections = [_section(path) for path in sorted(RESULTS.glob("*.json"))]
    return markdown.replace(MARKER, "\n\n".join(sections))


def _section(path: Path) -> str:
    data = json.loads(path.read_text())
    head = f"## `{path.name}` {{ #{path.stem} }}\n\n[raw JSON](../bench/results/{path.name})\n\n"
    if "result" not in data:  # a result kept before bench/_common.report existed
        return head + _table(_flatten(data))
    machine = data.get("machine") or {}
    about = {
        "command": f"`{data.get('command', '')}`",
        "ran": f"{data.get('started_utc', '?')} to {data.get('finished_utc', '?')}",
        "commit": f"`{str(data.get('git_commit', '?'))[:12]}`"
        + (" (uncommitted changes)" if data.get("git_dirty") else ""),
        "machine": ", ".join(f"{k} {_value(v)}" for k, v in machine.items()),
    }
    if data.get("note"):
        about["note"] = str(data["note"])
    return head + _table(about) + "\n\n" + _table(_flatten(data["result"]))


def _flatten(value, prefix=""):
    if isinstance(value, dict) and value:
        out = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix or "value": _value(value)}


def _value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        shown = ", ".join(_value(v) for v in value[:MAX_LIST])
        more = f", ... ({len(value)} in all)" if len(value) > MAX_LIST else ""
        return f"[{shown}{more}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return "—" if value is None else str(value)


def _table(rows: dict) -> str:
    lines = ["| field | value |", "|---|---|"]
    lines += [f"| {_cell(k)} | {_cell(v)} |" for k, v in rows.items()]
    return "\n".join(lines)


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")
