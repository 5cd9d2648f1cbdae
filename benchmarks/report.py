"""How every benchmark saves its figures, and how the documents show them.

Each benchmark is a folder, `benchmarks/<name>/`: its script `run.py`, its page `README.md` and its
`results/`; past code measured on purpose is kept in `benchmarks/experiments/`. A benchmark prints
its table and writes OUT.md and OUT.json side by side; the JSON carries its provenance: the commit,
the command, the date, how long the run took, a digest of the code it measures and one of the
benchmark script itself, each byte for byte and as logic (Python as its syntax tree without
docstrings, `logic_digest`), so that comments, docstrings and layout do not make a result stale. The
figures in the README, the results book (`docs/results.md`) and the benchmarks' pages are
generated from those files (`python -m benchmarks.report`, `make docs`) between markers
`<!-- results NAME -->` and `<!-- /results -->` (`<!-- results NAME: Heading | Heading -->` shows
only the file's opening text and the `####` sections whose headings start so), and a result whose
measured code or script has changed since is marked stale there, so a table can neither drift from
its file nor outlive its code without saying so; the book's index of stale results
(`<!-- stale index -->`) and each benchmark page's list of its results (`<!-- list of results -->`)
are computed too. A test holds the documents to what this module generates.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import functools
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import ModuleType

import psutil

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
README = ROOT / "README.md"
# The documents whose figures are generated: the front page, the book and each benchmark's own page.
DOCUMENTS = (README, *sorted((ROOT / "docs").glob("*.md")), *sorted(BENCHMARKS.glob("*/README.md")))
# What the figures of a benchmark depend on: the server's code, its models and its configuration
# (the benchmark scripts are the instrument, not what is measured).
SERVER_CODE = ("confkv",)
SOURCE_SNAPSHOT_ENV = "CONFKV_SOURCE"
_BLOCK = re.compile(r"(<!-- results (?P<name>[\w-]+)(?:: (?P<sections>[^>]+?))? -->\n).*?(<!-- /results -->)", re.S)
_SECTION = re.compile(r"^(?=#### )", re.M)
_INDEX = re.compile(r"(<!-- stale index -->\n).*?(<!-- /stale index -->)", re.S)
_LIST = re.compile(r"(<!-- list of results -->\n).*?(<!-- /list of results -->)", re.S)


@dataclass(frozen=True)
class Provenance:
    """Which code a result measured and how it was made."""

    commit: str
    date: str
    command: str  # in today's layout; `command_as_run` keeps the words it ran with where they differ
    measures: tuple[str, ...]
    code_digest: str
    uncommitted: bool = False  # the measured paths differed from the commit when it ran
    historical: str = ""  # why a result of past code is kept (it is then never stale)
    script: str = ""  # the benchmark script, relative to the repository ("": not recorded, older results)
    script_digest: str = ""
    command_as_run: str = ""
    logic_digest: str = ""  # of the measured code as logic ("": compare bytes only, older results)
    script_logic_digest: str = ""
    seconds: int = 0  # how long the run took, from its process's start to its files (0: not recorded, older results)

    @classmethod
    def capture(cls, measures: tuple[str, ...] = SERVER_CODE) -> Provenance:
        """The code as it stands now: call it when the benchmark starts, before anything can change."""
        digest = code_digest(measures)
        script = Path(sys.argv[0]).resolve()
        script_path = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) and script.is_file() else ""
        return cls(
            commit=commit_of(),
            date=datetime.date.today().isoformat(),
            command=command_line(sys.argv),
            measures=tuple(measures),
            code_digest=digest,
            uncommitted=digest != code_digest(measures, rev="HEAD"),
            script=script_path,
            script_digest=code_digest((script_path,)) if script_path else "",
            logic_digest=logic_digest(measures),
            script_logic_digest=logic_digest((script_path,)) if script_path else "",
        )

    @classmethod
    def of(cls, data: dict) -> Provenance:
        raw = data.get("provenance")
        if raw is None:
            raise ValueError("no provenance: re-run the benchmark, which records it")
        return cls(**{**raw, "measures": tuple(raw["measures"])})

    def is_stale(self) -> bool:
        """The measured code, or the script that measured it, has changed since (never for a historical record)."""
        if self.historical:
            return False
        return self.code_changed() or self.script_changed()

    def code_changed(self) -> bool:
        return _changed(self.measures, self.code_digest, self.logic_digest)

    def script_changed(self) -> bool:
        return bool(self.script) and _changed((self.script,), self.script_digest, self.script_logic_digest)


def _changed(paths: tuple[str, ...], digest: str, logic: str) -> bool:
    """The files under `paths` differ from those digested, in their logic where it was recorded."""
    return code_digest(paths) != digest and (not logic or logic_digest(paths) != logic)


def save_report(
    out: Path,
    title: str,
    table: str,
    data: dict,
    args: argparse.Namespace | None = None,
    provenance: Provenance | None = None,
) -> None:
    """Print `table`; write it as OUT.md under `title`, and `data` (with the run's arguments and
    provenance, captured now unless given, and how long the run has taken) as OUT.json."""
    print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(f"# {title}\n\n{table}\n")
    # Arguments as text, files by name only (a full path would name this machine's folders).
    given = vars(args).items() if args is not None else ()
    settings = {"args": {k: _text(v) for k, v in given if k not in ("out", "provenance")}} if given else {}
    took = round(time.time() - psutil.Process().create_time())
    record = {"provenance": asdict(replace(provenance or Provenance.capture(), seconds=took)), **settings, **data}
    out.with_suffix(".json").write_text(json.dumps(record, indent=2))


def pyplot() -> ModuleType:
    """matplotlib's pyplot, drawing to files only; imported when a benchmark plots, not before."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def commit_of(rev: str = "HEAD") -> str:
    """The short hash of a git revision of this repository (what a result names as measured); in a
    copy without git, the commit its source snapshot recorded (HEAD only)."""
    if snapshot := source_snapshot():
        if rev != "HEAD":
            raise ValueError(f"{ROOT} is a copy without git: only HEAD ({snapshot['commit']}) is known, not {rev}")
        return snapshot["commit"]
    return _git("rev-parse", "--short", rev).strip()


def code_digest(paths: tuple[str, ...], rev: str | None = None, root: Path | None = None) -> str:
    """A digest of the files git tracks under `paths` (of this repository unless `root`): in the working
    tree, or at git revision `rev`."""
    digest = hashlib.sha256()
    for path, blob in _tracked(paths, rev, root or ROOT):
        digest.update(f"{path}\0{blob}\n".encode())
    return digest.hexdigest()[:16]


def logic_digest(paths: tuple[str, ...], rev: str | None = None, root: Path | None = None) -> str:
    """`code_digest` of what the files do: a Python file counts as its syntax tree without docstrings,
    so that its comments, docstrings and layout change nothing; any other file counts byte for byte."""
    root = root or ROOT
    digest = hashlib.sha256()
    for path, blob in _tracked(paths, rev, root):
        digest.update(f"{path}\0{_logic(path, blob, root)}\n".encode())
    return digest.hexdigest()[:16]


def _tracked(paths: tuple[str, ...], rev: str | None, root: Path) -> list[tuple[str, str]]:
    """(path, git blob hash) of the files git tracks under `paths`, sorted by path: in the working tree
    (a deleted file's blob is ""), or at revision `rev`."""
    snapshot = source_snapshot(root)
    if snapshot:  # a copy without git: HEAD is what the snapshot recorded
        committed = {path: blob for path, blob in snapshot["files"].items() if _under(path, paths)}
        files = sorted(committed)
        return [(path, committed[path] if rev else _blob(root / path)) for path in files]
    if rev is None:
        files = sorted(_git("ls-files", "-z", "--", *paths, cwd=root).split("\0")[:-1])
        return [(path, _blob(root / path)) for path in files]
    listing = _git("ls-tree", "-r", rev, "--", *paths, cwd=root)
    return sorted((path, meta.split()[2]) for meta, path in (line.split("\t", 1) for line in listing.splitlines()))


@functools.cache
def _logic(path: str, blob: str, root: Path) -> str:
    """A file's part of `logic_digest`: its blob, or for Python that parses, a hash of its syntax tree
    without docstrings (read from the working tree where it holds that blob, else from git)."""
    if not path.endswith(".py") or not blob:
        return blob
    file = root / path
    data = file.read_bytes() if _blob(file) == blob else _git_bytes("cat-file", "blob", blob, cwd=root)
    try:
        tree = ast.parse(data)
    except SyntaxError:
        return blob
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and _docstring(node):
            node.body = node.body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def _docstring(node: ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    first = node.body[0] if node.body else None
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)


def source_snapshot(root: Path = ROOT) -> dict | None:
    """The commit and the blobs of every file git tracks at HEAD, as recorded by `snapshot_source()`
    for a copy of this tree at `root` without git (file $CONFKV_SOURCE, e.g. on a machine the tree was
    copied to); None in a git checkout, where git itself says."""
    path = os.environ.get(SOURCE_SNAPSHOT_ENV)
    if not path or (root / ".git").exists():
        return None
    return json.loads(Path(path).read_text())


def snapshot_source() -> dict:
    """What `source_snapshot()` reads in a copy without git: the commit and every tracked file's blob at HEAD."""
    listing = _git("ls-tree", "-r", "HEAD")
    files = {line.split("\t", 1)[1]: line.split()[2] for line in listing.splitlines()}
    return {"commit": commit_of(), "files": files}


def _blob(path: Path) -> str:
    """The git blob hash of a file's content (`git hash-object`), without git; "" for a deleted file."""
    if not path.is_file():
        return ""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _under(path: str, paths: tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in paths)


def result_folders(benchmarks: Path = BENCHMARKS) -> list[Path]:
    """Where results are kept: each benchmark's `results/`, and `experiments/` for past code measured on purpose."""
    return [*sorted(benchmarks.glob("*/results")), benchmarks / "experiments"]


def result_file(name: str, folders: list[Path]) -> Path:
    """Results NAME's JSON file; names are unique over all the folders."""
    found = [folder / f"{name}.json" for folder in folders if (folder / f"{name}.json").is_file()]
    if len(found) != 1:
        raise ValueError(f"results {name!r}: {len(found)} files named {name}.json in {[str(f) for f in folders]}")
    return found[0]


def readme_block(name: str, folders: list[Path], sections: tuple[str, ...] = (), document_dir: Path = ROOT) -> str:
    """What a document in `document_dir` shows for results NAME: its provenance, staleness and tables
    (all, or the opening text and the `####` sections whose headings start with one of `sections`)."""
    path = result_file(name, folders)
    prov = Provenance.of(json.loads(path.read_text()))
    body = path.with_suffix(".md").read_text().split("\n", 1)[1].strip()  # without its title
    if sections:
        opening, *parts = _SECTION.split(body)
        chosen = [part.strip() for part in parts if part.removeprefix("#### ").startswith(sections)]
        if len(chosen) < len(sections):
            raise ValueError(f"{name}.md lacks a section starting with one of {sections}")
        body = "\n\n".join([opening.strip(), *chosen])
    file = f"{name}.md" if sections else f"{name}.json"
    source = f"[`{file}`]({_link(path.with_name(file), document_dir)}){', in part' if sections else ''}"
    state = " (with uncommitted changes)" if prov.uncommitted else ""
    lines = [f"*{source}: measured at {prov.commit}{state} on {prov.date}{_took(prov, ' in ')} by `{prov.command}`.*"]
    if prov.historical:
        lines.append(
            f"*Historical: {prov.historical} `{name}.json` is stale for today's code by design: the code it "
            f"measures ({', '.join(prov.measures)}) has changed since {prov.commit}, and it is never re-run.*"
        )
    elif prov.is_stale():
        lines.append(
            f"> **Stale:** `{name}.json` measured code ({', '.join(_measured(prov))}) that has changed "
            f"since {prov.commit}; "
            "re-run the command above, then `make docs`."
        )
    return "\n\n".join([*lines, body]) + "\n"


def render_document(text: str, document: Path = README, folders: list[Path] | None = None) -> str:
    """`text` (of `document`) with every results block, the stale index and, on a benchmark's page, the
    list of its results regenerated from the files."""
    folders = result_folders() if folders is None else folders

    def block(match: re.Match) -> str:
        sections = tuple(s.strip() for s in (match["sections"] or "").split("|") if s.strip())
        return match.group(1) + readme_block(match["name"], folders, sections, document.parent) + match.group(4)

    text = _INDEX.sub(lambda m: m.group(1) + stale_index(folders, document.parent) + m.group(2), text)
    text = _LIST.sub(
        lambda m: m.group(1) + results_list(document.parent / "results", document.parent) + m.group(2), text
    )
    return _BLOCK.sub(block, text)


def results_list(folder: Path, document_dir: Path) -> str:
    """A benchmark's results: each file, whether it is current, and the command that makes it."""
    lines = []
    for path in sorted(folder.glob("*.json")):
        prov = Provenance.of(json.loads(path.read_text()))
        state = "stale" if prov.is_stale() else "current"
        took = _took(prov, ", ")
        lines.append(f"- [`{path.name}`]({_link(path, document_dir)}), {prov.commit}, {state}{took}: `{prov.command}`")
    return "\n".join(lines or ["- none yet"]) + "\n"


def _link(path: Path, document_dir: Path) -> str:
    return Path(os.path.relpath(path, document_dir)).as_posix()


def stale_index(folders: list[Path], document_dir: Path) -> str:
    """Every result whose measured code or script changed since it ran (with how long its last run took,
    where recorded, and what re-running them all takes), and every historical one."""
    stale, historical, took = [], [], {}
    for path, prov in _results(folders):
        entry = f"[`{path.name}`]({_link(path, document_dir)}), {prov.commit}"
        if prov.historical:
            historical.append(f"- {entry}: {prov.historical}")
        elif prov.is_stale():
            changed = ", ".join(_measured(prov, changed=True))
            stale.append(f"- {entry}{_took(prov, ', last run ')}: changed since: {changed}; re-run `{prov.command}`")
            took[prov.command] = max(took.get(prov.command, 0), prov.seconds)  # one command may make several
    lines = ["**Stale** (re-run before reading their figures as today's):", "", *(stale or ["- none"])]
    if timed := [seconds for seconds in took.values() if seconds]:
        untimed = len(took) - len(timed)
        more = f", and more: {untimed} of the {len(took)} commands never recorded theirs" if untimed else ""
        lines += ["", f"Re-running them takes about {_duration(sum(timed))} by their last runs{more}."]
    lines += ["", "**Historical** (past code measured on purpose, never re-run):", "", *(historical or ["- none"])]
    return "\n".join(lines) + "\n"


def _took(prov: Provenance, words: str) -> str:
    """`words` and how long the result's run took, or nothing where it was not recorded."""
    return f"{words}{_duration(prov.seconds)}" if prov.seconds else ""


def _duration(seconds: int) -> str:
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min" if minutes else "under a minute"
    return f"{minutes // 60} h {minutes % 60:02d}"


def stale_commands(folders: list[Path]) -> list[str]:
    """The commands that re-make every stale result, each once, in the stale index's order."""
    commands = [prov.command for _, prov in _results(folders) if not prov.historical and prov.is_stale()]
    return list(dict.fromkeys(commands))


def _results(folders: list[Path]) -> list[tuple[Path, Provenance]]:
    paths = sorted((p for folder in folders for p in folder.glob("*.json")), key=lambda p: p.name)
    return [(path, Provenance.of(json.loads(path.read_text()))) for path in paths]


def _measured(prov: Provenance, changed: bool = False) -> list[str]:
    """The paths a result depends on: the code it measures and its script (only those that changed)."""
    paths = [*prov.measures, *([prov.script] if prov.script else [])]
    if not changed:
        return paths
    return [*(prov.measures if prov.code_changed() else ()), *([prov.script] if prov.script_changed() else [])]


def command_line(argv: list[str]) -> str:
    """`python` and `argv` as a command line, paths inside the repository relative to it and others
    by name (a full path would name this machine's folders)."""
    words = []
    for word in argv:
        path = Path(word)
        if path.is_absolute():
            word = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
        words.append(word)
    return shlex.join(["python", *words])


def _git(*args: str, input: str | None = None, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, input=input).stdout


def _git_bytes(*args: str, cwd: Path = ROOT) -> bytes:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True).stdout


def _text(value: object) -> str:
    if isinstance(value, Path):
        return value.name
    if isinstance(value, list) and value and all(isinstance(v, Path) for v in value):
        return str([v.name for v in value])
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description="Regenerate the documents' figures from the benchmarks' results.")
    parser.add_argument("--check", action="store_true", help="exit 1 if a document differs, write nothing")
    parser.add_argument(
        "--stale-commands", action="store_true", help="print the commands that re-make the stale results, write nothing"
    )
    args = parser.parse_args()
    if args.stale_commands:
        print("\n".join(stale_commands(result_folders())))
        return
    for document in DOCUMENTS:
        text = document.read_text()
        rendered = render_document(text, document)
        if args.check:
            if rendered != text:
                sys.exit(f"{document.name}: figures differ from the benchmarks' results: run `make docs`")
            continue
        document.write_text(rendered)
        for match in _BLOCK.finditer(rendered):
            block = match.group(0)
            state = (
                "stale"
                if "**Stale:**" in block
                else "historical (stale by design)"
                if "*Historical:" in block
                else "current"
            )
            print(f"{document.name} {match['name']}: {state}")


if __name__ == "__main__":
    main()
