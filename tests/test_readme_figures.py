"""The documents' figures are generated from the benchmarks' results and say when their code or script has
changed; the settings tables are generated from the settings' declarations."""

import json
import re
import subprocess
from dataclasses import asdict, replace
from datetime import date
from types import SimpleNamespace

import pytest

from benchmarks.report import (
    DOCUMENTS,
    README,
    Provenance,
    code_digest,
    logic_digest,
    readme_block,
    render_document,
    result_file,
    result_folders,
    results_list,
    save_report,
    stale_commands,
    stale_index,
)
from scripts import settings_reference


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(README.parent)))
def test_every_document_is_what_its_results_files_generate(document):
    text = document.read_text()
    assert render_document(text, document) == text, f"{document.name} differs from the results: run `make docs`"


def test_the_readme_and_the_results_book_show_figures_and_the_book_computes_its_stale_index():
    assert "<!-- results " in README.read_text()
    book = (README.parent / "docs" / "results.md").read_text()
    assert "<!-- results " in book and "<!-- stale index -->" in book


def test_configuration_doc_is_generated_from_every_setting():
    text = settings_reference.DOCUMENT.read_text()
    assert settings_reference.render(text) == text, "docs/configuration.md differs from the settings: run `make docs`"
    for flag in ("--max-cache-size", "--cluster.replicas", "`kv_cache_dtype`", "`confidence_thresholds`", "`medium`"):
        assert flag in text


RESULT_FILES = sorted((p for folder in result_folders() for p in folder.glob("*.json")), key=lambda p: p.name)


def test_every_benchmark_is_a_folder_with_its_script_page_and_results_and_result_names_are_unique():
    folders = [f.parent for f in result_folders() if f.name == "results"]
    assert {f.name for f in folders} >= {"decode_step", "quality", "ruler", "serving_http", "prefix_cache"}
    for folder in folders:
        assert (folder / "README.md").is_file(), f"{folder.name} has no page"
        assert (folder / "run.py").is_file() or folder.name == "load_alerts", f"{folder.name} has no run.py"
    names = [p.stem for p in RESULT_FILES]
    assert len(names) == len(set(names)), "two results files share a name"
    assert result_file("decode_step", result_folders()).parent.parent.name == "decode_step"


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.stem)
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


def test_the_logic_digest_ignores_comments_docstrings_and_layout_and_nothing_else(tmp_path):
    engine = tmp_path / "app" / "engine.py"
    engine.parent.mkdir()
    engine.write_text('"""The engine."""\n\ndef step(x):\n    return x + 1\n')
    (tmp_path / "app" / "rates.yaml").write_text("rate: 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "first")
    before = logic_digest(("app",), root=tmp_path)
    assert logic_digest(("app",), rev="HEAD", root=tmp_path) == before
    engine.write_text('"""The engine, said again."""\n\n\ndef step(x):  # why\n    """A step."""\n    return (x + 1)\n')
    assert logic_digest(("app",), root=tmp_path) == before
    assert code_digest(("app",), root=tmp_path) != code_digest(("app",), rev="HEAD", root=tmp_path)
    assert logic_digest(("app",), rev="HEAD", root=tmp_path) == before  # read from git: the file differs now
    engine.write_text('"""The engine."""\n\ndef step(x):\n    return x + 2\n')
    assert logic_digest(("app",), root=tmp_path) != before
    engine.write_text('"""The engine."""\n\ndef step(x):\n    "a string that is not the first statement"\n')
    assert logic_digest(("app",), root=tmp_path) != before
    _git(tmp_path, "checkout", "--", "app/engine.py")
    (tmp_path / "app" / "rates.yaml").write_text("rate: 1  # other files count byte for byte\n")
    assert logic_digest(("app",), root=tmp_path) != before


def test_a_result_with_a_logic_digest_stays_current_through_comments_only(tmp_path, monkeypatch):
    engine = tmp_path / "app" / "engine.py"
    engine.parent.mkdir()
    engine.write_text("def step(x):\n    return x + 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "first")
    monkeypatch.setattr("benchmarks.report.ROOT", tmp_path)
    monkeypatch.setattr("benchmarks.report.commit_of", lambda rev="HEAD": "0000000")
    prov = Provenance.capture(("app",))
    older = replace(prov, logic_digest="")  # made before logic digests were recorded: bytes alone
    assert prov.logic_digest and not prov.is_stale() and not older.is_stale()
    engine.write_text("def step(x):\n    # the next token\n    return x + 1\n")
    assert not prov.is_stale() and older.is_stale()
    engine.write_text("def step(x):\n    return x - 1\n")
    assert prov.is_stale() and prov.code_changed()


def test_a_block_says_stale_once_the_measured_code_changed_and_never_for_a_historical_record(tmp_path):
    now = Provenance.capture(("app",))
    (tmp_path / "run.md").write_text("# Title\n\n| a |\n| --- |\n| 1 |\n")

    def block(prov):
        (tmp_path / "run.json").write_text(json.dumps({"provenance": asdict(prov)}))
        return readme_block("run", [tmp_path])

    current = block(now)
    assert "Stale" not in current and current.endswith("| 1 |\n") and "# Title" not in current
    assert f"measured at {now.commit}" in current
    changed = replace(now, code_digest="0" * 16, logic_digest="0" * 16)
    assert "Stale" in block(changed)
    historical = block(replace(changed, historical="the code before X."))
    assert "Stale" not in historical and "Historical: the code before X." in historical


def test_a_block_may_show_only_some_sections_of_its_file(tmp_path):
    (tmp_path / "run.md").write_text("# Title\n\nCases.\n\n#### Needle\n\n| n |\n\n#### Perplexity\n\n| p |\n")
    (tmp_path / "run.json").write_text(json.dumps({"provenance": asdict(Provenance.capture(("app",)))}))
    part = readme_block("run", [tmp_path], ("Perplexity",))
    assert "Cases." in part and "#### Perplexity\n\n| p |" in part and "Needle" not in part and "in part" in part
    text = "<!-- results run: Needle | Perplexity -->\n<!-- /results -->\n"
    rendered = render_document(text, tmp_path / "README.md", [tmp_path])
    assert "| n |" in rendered and "| p |" in rendered
    with pytest.raises(ValueError, match="lacks a section"):
        readme_block("run", [tmp_path], ("Latency",))


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
    assert "- none" in stale_index([results], tmp_path).split("**Historical**")[0]
    listed = results_list(results, tmp_path)
    assert listed == f"- [`run.json`](results/run.json), {prov.commit}, current: `{prov.command}`\n"
    script.write_text("rate = 2\n")
    index = stale_index([results], tmp_path / "docs")
    assert "[`run.json`](../results/run.json)" in index and "benchmarks/bench.py" in index
    assert "Stale" in readme_block("run", [results]) and ", stale:" in results_list(results, tmp_path)
    (results / "run_b.json").write_text((results / "run.json").read_text())  # made by the same command
    assert stale_commands([results]) == [prov.command]


def test_a_result_records_how_long_its_run_took_and_the_index_adds_up_the_stale_ones(tmp_path, monkeypatch):
    monkeypatch.setattr("benchmarks.report.time.time", lambda: 10_000.0)
    monkeypatch.setattr("benchmarks.report.psutil.Process", lambda: SimpleNamespace(create_time=lambda: 4_960.0))
    old = replace(Provenance.capture(("app",)), code_digest="0" * 16, logic_digest="0" * 16)  # stale
    save_report(tmp_path / "slow", "Slow", "| a |", {}, provenance=old)
    assert json.loads((tmp_path / "slow.json").read_text())["provenance"]["seconds"] == 5_040
    block = readme_block("slow", [tmp_path])
    assert "measured at" in block and " in 1 h 24 by `" in block
    assert ", stale, 1 h 24: `" in results_list(tmp_path, tmp_path)
    index = stale_index([tmp_path], tmp_path)
    assert "slow.json`](slow.json), " + old.commit + ", last run 1 h 24:" in index
    assert "Re-running them takes about 1 h 24 by their last runs." in index
    (tmp_path / "untimed.md").write_text("# Untimed\n")
    (tmp_path / "untimed.json").write_text(json.dumps({"provenance": asdict(replace(old, command="python other.py"))}))
    index = stale_index([tmp_path], tmp_path)
    assert "about 1 h 24 by their last runs, and more: 1 of the 2 commands never recorded theirs." in index
    assert ", stale: `python other.py`" in results_list(tmp_path, tmp_path)  # nothing said of a time not recorded


def _anchors(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    headings = re.findall(r"^#{1,6} (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(README.parent)))
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
