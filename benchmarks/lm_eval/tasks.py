"""The local lm-eval tasks this project ships (nothing is downloaded): `confkv_choices`, 44 multiple-choice
questions (capitals, opposites, sums, colours; lm-eval's `loglikelihood` requests, scored by accuracy), and
`confkv_text`, three paragraphs scored by perplexity (its `loglikelihood_rolling` requests)."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
TASKS = ("confkv_choices", "confkv_text")

_CHOICES = """task: confkv_choices
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/choices.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
_TEXT = """task: confkv_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/text.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: text
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def write_tasks(folder: Path) -> Path:
    """The tasks' YAML files in `folder` (for lm-eval's `--include_path`), naming the data files where
    they lie: lm-eval reads a data file's path from the working directory, not from the YAML's."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("confkv_choices", _CHOICES), ("confkv_text", _TEXT)):
        (folder / f"{name}.yaml").write_text(text.format(data=DATA))
    return folder
