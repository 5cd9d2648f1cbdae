"""The README's figures are generated from benchmarks/results and say when their code has changed."""

import json
import subprocess
from dataclasses import asdict, replace
from datetime import date

import pytest

from benchmarks.report import README, RESULTS, Provenance, code_digest, readme_block, render_readme


def test_readme_figures_are_what_their_results_files_generate():
    text = README.read_text()
    assert "<!-- results " in text
    assert render_readme(text) == text, "README figures differ from benchmarks/results: run `make readme`"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.stem)
def test_every_results_file_names_its_commit_command_date_and_measured_code(path):
    prov = Provenance.of(json.loads(path.read_text()))
    assert len(prov.commit) >= 7 and prov.command.startswith(("python benchmarks/", "python load_tests/"))
    assert date.fromisoformat(prov.date) and prov.measures and len(prov.code_digest) == 16


def _git(root, *args):
    identity = ["-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", *identity, *args], cwd=root, check=True, capture_output=True)


def test_the_code_digest_changes_with_the_measured_files_only(tmp_path):
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "engine.py").write_text("step = 1\n")
    (tmp_path / "notes.md").write_text("a\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "first")
    before = code_digest(("app",), root=tmp_path)
    assert code_digest(("app",), rev="HEAD", root=tmp_path) == before
    (tmp_path / "notes.md").write_text("b\n")
    assert code_digest(("app",), root=tmp_path) == before
    (tmp_path / "app" / "engine.py").write_text("step = 2\n")
    assert code_digest(("app",), root=tmp_path) != before
    assert code_digest(("app",), rev="HEAD", root=tmp_path) == before


def test_a_block_says_stale_once_the_measured_code_changed_and_never_for_a_historical_record(tmp_path):
    now = Provenance.capture(("app",))
    (tmp_path / "run.md").write_text("# Title\n\n| a |\n| --- |\n| 1 |\n")

    def block(prov):
        (tmp_path / "run.json").write_text(json.dumps({"provenance": asdict(prov)}))
        return readme_block("run", tmp_path)

    current = block(now)
    assert "Stale" not in current and current.endswith("| 1 |\n") and "# Title" not in current
    assert f"measured at {now.commit}" in current
    assert "Stale" in block(replace(now, code_digest="0" * 16))
    historical = block(replace(now, code_digest="0" * 16, historical="the code before X."))
    assert "Stale" not in historical and "Historical: the code before X." in historical


def test_a_block_may_show_only_some_sections_of_its_file(tmp_path):
    (tmp_path / "run.md").write_text("# Title\n\nCases.\n\n#### Needle\n\n| n |\n\n#### Perplexity\n\n| p |\n")
    (tmp_path / "run.json").write_text(json.dumps({"provenance": asdict(Provenance.capture(("app",)))}))
    part = readme_block("run", tmp_path, ("Perplexity",))
    assert "Cases." in part and "#### Perplexity\n\n| p |" in part and "Needle" not in part and "in part" in part
    text = "<!-- results run: Needle | Perplexity -->\n<!-- /results -->\n"
    assert "| n |" in render_readme(text, tmp_path) and "| p |" in render_readme(text, tmp_path)
    with pytest.raises(ValueError, match="lacks a section"):
        readme_block("run", tmp_path, ("Latency",))
