"""The local lm-eval tasks this project ships (nothing is downloaded): `confkv_choices`, 44 multiple-choice
questions (capitals, opposites, sums, colours; lm-eval's `loglikelihood` requests, scored by accuracy), and
`confkv_text`, three paragraphs scored by perplexity (its `loglikelihood_rolling` requests)."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"

# Each task: its data file (under DATA) and what lm-eval does with it.
_TASKS = {
    "confkv_choices": (
        "choices.jsonl",
        """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""",
    ),
    "confkv_text": (
        "text.jsonl",
        """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: text
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    ),
}
TASKS = tuple(_TASKS)


def write_tasks(folder: Path) -> Path:
    """The tasks' YAML files in `folder` (for lm-eval's `--include_path`), naming the data files where
    they lie: lm-eval reads a data file's path from the working directory, not from the YAML's."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (data, scoring) in _TASKS.items():
        source = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {DATA / data}\n"
        (folder / f"{name}.yaml").write_text(f"{source}test_split: test\n{scoring}")
    return folder
