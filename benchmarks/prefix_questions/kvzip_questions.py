"""kvpress's KVzipPress on the prefix-questions protocol, in kvpress's own environment.

KVzip is query-agnostic: it compresses a document once, with no question, keeping the entries the
model needs to reconstruct the document, and the compressed cache then serves any question. kvpress's
pipeline compresses the context before it appends the question, which is exactly that protocol. Reads
the cases that `benchmarks/prefix_questions/run.py --peers` writes (document, question, rates) and writes
the answers; prefix_questions.py scores them as it scores ours.

    .venv-peers/bin/python benchmarks/prefix_questions/kvzip_questions.py --cases cases.json --out answers.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from kvpress import KVzipPress
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quality"))  # kvpress_runner, its loader

from kvpress_runner import load  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=Path, required=True, help="written by benchmarks/prefix_questions/run.py")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = json.loads(args.cases.read_text())
    pipe = load(spec["model_path"], eager=False)
    answers: dict[str, dict[str, str]] = {}
    with torch.inference_mode():
        for rate in spec["rates"]:
            for case in tqdm(spec["cases"], desc=f"KVzip, rate {rate}", unit="case"):
                out = pipe(
                    case["context"],
                    question=case["question"],
                    press=KVzipPress(compression_ratio=rate),
                    max_new_tokens=case["max_tokens"],
                )
                answers.setdefault(str(rate), {})[case["name"]] = out["answer"]
    args.out.write_text(json.dumps({"answers": answers}, indent=1))


if __name__ == "__main__":
    main()
