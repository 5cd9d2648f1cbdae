"""The documents' figures are generated from benchmarks/results and say when their code or script has
changed; the settings tables are generated from the settings' declarations."""

import json
import re
import subprocess
from dataclasses import asdict, replace
from datetime import date

import pytest

from benchmarks.report import (
    DOCUMENTS,
    README,
    RESULTS,
    Provenance,
    code_digest,
    readme_block,
    render_document,
    stale_index,
)
from scripts import settings_reference


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_document_is_what_its_results_files_generate(document):
    text = document.read_text()
    assert render_document(text, document) == text, f"{document.name} differs from benchmarks/results: run `make docs`"


def test_the_readme_and_the_results_book_show_figures_and_the_book_computes_its_stale_index():
    assert "<!-- results " in README.read_text()
    book = (README.parent / "docs" / "results.md").read_text()
    assert "<!-- results " in book and "<!-- stale index -->" in book


def test_configuration_doc_is_generated_from_every_setting():
    text = settings_reference.DOCUMENT.read_text()
    assert settings_reference.render(text) == text, "docs/configuration.md differs from the settings: run `make docs`"
    for flag in ("--max-cache-size", "--cluster.replicas", "`kv_cache_dtype`", "`confidence_thresholds`", "`medium`"):
        assert flag in text


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
    assert "| n |" in render_document(text, results=tmp_path) and "| p |" in render_document(text, results=tmp_path)
    with pytest.raises(ValueError, match="lacks a section"):
        readme_block("run", tmp_path, ("Latency",))


def test_a_result_goes_stale_when_its_script_changes_and_the_index_lists_it(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    script = root / "benchmarks" / "bench.py"
    script.write_text("rate = 1\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "first")
    monkeypatch.setattr("benchmarks.report.ROOT", root)
    monkeypatch.setattr("sys.argv", [str(script)])
    prov = replace(Provenance.capture(("benchmarks/none",)), code_digest=code_digest(("app",)))
    assert prov.script == "benchmarks/bench.py" and prov.script_digest
    results = tmp_path / "results"
    results.mkdir()
    (results / "run.md").write_text("# Title\n\n| a |\n")
    (results / "run.json").write_text(json.dumps({"provenance": asdict(replace(prov, measures=("app",)))}))
    assert "- none" in stale_index(results).split("**Historical**")[0]
    script.write_text("rate = 2\n")
    index = stale_index(results, link="../results")
    assert "[`run.json`](../results/run.json)" in index and "benchmarks/bench.py" in index
    assert "Stale" in readme_block("run", results)


def _anchors(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    headings = re.findall(r"^#{1,6} (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_link_between_the_documents_resolves(document):
    text = re.sub(r"```.*?```", "", document.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        path = (document.parent / file).resolve() if file else document
        assert path.exists(), f"{document.name} links {target}: no such file"
        if anchor:
            assert anchor in _anchors(path), f"{document.name} links {target}: no such heading"


def test_a_setting_without_a_description_cannot_be_documented():
    from pydantic import BaseModel, Field

    class Described(BaseModel):
        said: int = Field(1, ge=0, description="a setting that says what it is")

    class Undescribed(Described):
        silent: int = 2

    assert "| `said` | `1` | integer >= 0 | a setting that says what it is |" in settings_reference.policy_file_table(
        Described
    )
    with pytest.raises(ValueError, match="no description"):
        settings_reference.policy_file_table(Undescribed)
