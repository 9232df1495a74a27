"""The benches' one way of keeping a result (bench/_common.report), and the docs' promise
that every result file they cite (README.md and docs/) is committed."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import _common  # noqa: E402


def test_report_keeps_the_result_with_its_provenance(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(_common, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "x.py"), "--sessions", "3"])
    path = _common.report("x", {"median_s": 1.5})
    kept = json.loads(path.read_text())
    assert path.parent == tmp_path and re.fullmatch(r"x-\d{8}T\d{6}Z\.json", path.name)
    assert kept["result"] == {"median_s": 1.5}
    assert kept["command"] == "python bench/x.py --sessions 3"
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert kept["git_commit"] == head and isinstance(kept["git_dirty"], list)
    machine = kept["machine"]
    assert machine["cores"] >= 1 and machine["memory_gb"] > 0 and machine["cpu"]
    assert machine["torch"] and machine["pyspark"] and "gpu" in machine
    assert json.loads(capsys.readouterr().out) == {"median_s": 1.5}


def test_every_result_the_docs_cite_is_committed():
    # the README's figures moved to the documentation site (docs/); the README links there
    texts = [(ROOT / "README.md").read_text()]
    texts += [p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))]
    cited = set(re.findall(r"bench/results/[\w.-]+\.json", "\n".join(texts)))
    assert cited, "neither the README nor docs/ cites a bench result"
    tracked = set(subprocess.run(["git", "-C", str(ROOT), "ls-files", "bench/results"],
                                 capture_output=True, text=True).stdout.split())
    assert cited <= tracked, sorted(cited - tracked)
