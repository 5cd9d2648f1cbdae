"""The quality benchmark's measurements: perplexity through the compressor, scores, the kvpress hand-off."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from benchmarks.quality import run as quality
from benchmarks.quality.plan import RUNS, RunFile
from benchmarks.quality.run import Row, Setup, Tasks
from benchmarks.tasks import FidelityCase, NeedleCase


def test_teacher_forced_perplexity_through_the_uncompressed_cache_is_the_models(default_model, tokenizer):
    model = default_model
    ids = tokenizer(" ".join(f"Item {i} is filed under box {i % 7}." for i in range(40))).input_ids[:280]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    nll = -torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    want = math.exp(nll[256 - 1 :].mean().item())

    got, kept = quality.perplexity(model, tokenizer, ids, 256, Setup("uncompressed", "auto", "none", 0.0), None)
    assert got == pytest.approx(want, rel=1e-4)
    assert kept >= 1.0
    squeezed, kept = quality.perplexity(model, tokenizer, ids, 256, Setup("uniform int4", "int4", "none", 0.0), None)
    assert squeezed != pytest.approx(want, rel=1e-4) and kept < 0.3


def test_teacher_forced_fidelity_is_exact_against_itself_and_falls_with_compression(default_model, tokenizer):
    text = " ".join(f"Item {i} is filed under box {i % 7}." for i in range(60))
    prompt = tokenizer(text).input_ids[:400]
    with torch.inference_mode():  # the model's own greedy answer, as the uncompressed setup gives it
        answer = default_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 400:]
    tasks = Tasks([], [], {"case": prompt}, {"case": 12}, [], answers={"case": answer.tolist()})
    uncompressed = Setup("uncompressed", "auto", "none", 0.0)
    top1, kl = quality.teacher_forced_fidelity(default_model, tokenizer, uncompressed, tasks, None)
    assert tasks.reference["case"].shape == (12, default_model.config.vocab_size)  # recorded by the first setup
    assert top1 == 1.0 and kl == pytest.approx(0.0, abs=1e-6)
    int4 = quality.teacher_forced_fidelity(
        default_model, tokenizer, Setup("uniform int4", "int4", "none", 0.0), tasks, None
    )
    dropped = quality.teacher_forced_fidelity(default_model, tokenizer, Setup("h2o", "auto", "h2o", 0.9), tasks, None)
    for top1, kl in (int4, dropped):
        assert 0.0 <= top1 <= 1.0 and kl > 1e-4


def test_kivi4_keys_keep_the_model_closer_than_per_token_int4(default_model, tokenizer):
    """Same int4 values per token; keys per channel over blocks (kivi4) against per token, rotated
    (int4): the model's own next-token distributions move less."""
    text = " ".join(f"Item {i} is filed under box {i % 7}." for i in range(60))
    prompt = tokenizer(text).input_ids[:400]
    with torch.inference_mode():
        answer = default_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 400:]
    tasks = Tasks([], [], {"case": prompt}, {"case": 12}, [], answers={"case": answer.tolist()})
    quality.teacher_forced_fidelity(default_model, tokenizer, Setup("uncompressed", "auto", "none", 0.0), tasks, None)
    _, int4 = quality.teacher_forced_fidelity(
        default_model, tokenizer, Setup("uniform int4", "int4", "none", 0.0), tasks, None
    )
    _, kivi4 = quality.teacher_forced_fidelity(
        default_model, tokenizer, Setup("uniform kivi4", "kivi4", "none", 0.0), tasks, None
    )
    assert 0.0 < kivi4 < int4 / 4  # about 0.005 against 0.08 here


def _tasks() -> Tasks:
    needles = [NeedleCase(f"n{i}", [], "pelican-42", length, 0.5) for i, length in enumerate((1000, 1000, 2000, 2000))]
    summaries = [FidelityCase("s0", []), FidelityCase("s1", [])]
    max_tokens = {c.name: 16 for c in needles} | {c.name: 48 for c in summaries}
    return Tasks(needles, summaries, {}, max_tokens, list(range(quality.PPL_FORCED + 1)))


def test_scores_are_relative_to_the_reference_per_needle_length():
    tasks = _tasks()
    summary = "The module parses command line options and prints help for each of them."
    reference = Row(Setup("uncompressed", "auto", "none", 0.0))
    quality.score(reference, {"n0": "pelican-42", "n1": "no idea", "n2": "42 pelican", "n3": "pelican 42",
                              "s0": summary, "s1": summary}, None, tasks)  # fmt: skip
    assert reference.needle_by_length == {1000: 1.0, 2000: 1.0}  # against itself
    assert reference.rouge_l == pytest.approx(1.0) and reference.bleu == pytest.approx(1.0)

    row = Row(Setup("x", "auto", "tova", 0.6))
    quality.score(row, {"n0": "pelican-42", "n1": "pelican-42", "n2": "walnut-42", "n3": "no",
                        "s0": summary, "s1": "Something else entirely."}, reference, tasks)  # fmt: skip
    assert row.needle_by_length == {1000: 2.0, 2000: 0.0}  # 2 found where the reference found 1; none
    assert row.needle_relative == pytest.approx(1.0)
    assert 0.4 < row.rouge_l < 0.6 and 0.4 < row.bleu < 0.6  # one summary identical, one unrelated


def test_kvpress_results_come_back_as_rows_scored_against_kvpress_uncompressed(tmp_path, monkeypatch):
    # The runner's environment is not built in tests: a stand-in script checks the cases file it gets
    # and answers in the runner's format (what this test is about: the hand-off, not kvpress).
    runner = tmp_path / "runner.py"
    runner.write_text(
        "import json, sys\n"
        "args = sys.argv[1:]\n"
        "cases = json.load(open(args[args.index('--cases') + 1]))\n"
        "assert [c['max_tokens'] for c in cases['cases']] == [16, 16, 16, 16, 48, 48]\n"
        "assert cases['perplexity']['prefill'] == 1 and args[args.index('--rates') + 1] == '0.6'\n"
        "good = {'n0': 'pelican-42', 'n1': 'pelican-42', 'n2': 'pelican-42', 'n3': 'pelican-42',\n"
        "        's0': 'a b c d e', 's1': 'a b c d e'}\n"
        "runs = [{'press': 'none', 'rate': 0.0, 'outputs': good, 'perplexity': 9.0, 'seconds': 1.0},\n"
        "        {'press': 'SnapKV', 'rate': 0.6, 'outputs': {**good, 'n0': 'x'}, 'perplexity': 9.5, 'seconds': 1.0}]\n"
        "json.dump({'runs': runs}, open(args[args.index('--out') + 1], 'w'))\n"
    )
    monkeypatch.setattr(quality, "PEERS_PYTHON", Path(sys.executable))
    monkeypatch.setattr(quality, "PEERS_RUNNER", runner)
    tasks = _tasks()
    args = Namespace(rates=[0.6], presses=None, model_path=tmp_path)
    with quality.peers_alongside(args, tasks, threads=1) as peers:
        runs = peers()
    assert [setup.label for setup, _ in runs] == ["kvpress uncompressed", "kvpress SnapKV"]
    assert runs[1][0].source == "kvpress" and runs[1][0].rate == 0.6

    ours = Row(Setup("dynamic", "int8", "dynamic", 0.6), needle_relative=1.0, memory_kept=0.27, perplexity=9.1)
    ours.needle_by_length = {1000: 1.0, 2000: 1.0}
    rows = [ours, *quality.peer_rows(runs, tasks)]
    assert rows[2].needle_by_length == {1000: 0.5, 2000: 1.0}

    out = tmp_path / "quality"
    quality.report(rows, Namespace(threads=1, peers=True, peers_after=False, out=out, commit="abc1234"), tasks)
    table = out.with_suffix(".md").read_text()
    assert "1 CPU threads shared by our setups and kvpress's, which run at the same time" in table
    assert "| kvpress SnapKV | 75% (0.40) |" in table  # needle: score (memory kept)
    assert "| dynamic | 9.10 (0.00) |" in table  # perplexity column
    assert json.loads(out.with_suffix(".json").read_text())["rows"][2]["setup"]["source"] == "kvpress"
    measured = [task for task in quality.TASKS if not task.startswith("forced")]  # no row was teacher-forced
    assert all(out.with_name(f"quality_{task}.png").stat().st_size > 0 for task in measured)
    assert not out.with_name("quality_forced_kl.png").exists() and "top-1 agreement" not in table


def test_the_kvpress_runner_is_stopped_when_our_side_fails_and_its_failure_is_reported(tmp_path, monkeypatch):
    runner = tmp_path / "runner.py"
    runner.write_text(f"import os, sys, time\nopen({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\n"
                      "sys.exit(3) if '--fail' in sys.argv else time.sleep(120)\n")  # fmt: skip
    monkeypatch.setattr(quality, "PEERS_PYTHON", Path(sys.executable))
    monkeypatch.setattr(quality, "PEERS_RUNNER", runner)
    args = Namespace(rates=[0.6], presses=None, model_path=tmp_path)
    with pytest.raises(RuntimeError), quality.peers_alongside(args, _tasks(), threads=1):
        while not (tmp_path / "pid").exists():
            time.sleep(0.05)
        raise RuntimeError("our side failed")
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid").read_text()), 0)  # killed and reaped

    args.presses = ["--fail"]  # lands in the runner's command line
    with pytest.raises(SystemExit, match="kvpress runner failed"), quality.peers_alongside(args, _tasks(), 1) as peers:
        peers()


def test_saved_results_are_read_back_for_a_new_report(tmp_path):
    ours = Row(
        Setup("dynamic", "int8", "dynamic", 0.6), needle_by_length={1000: 1.0, 2000: 1.0}, rouge_l=0.9, perplexity=9.0
    )
    theirs = Row(
        Setup("kvpress SnapKV", "auto", "SnapKV", 0.6, source="kvpress"), needle_by_length={1000: 0.5, 2000: 0.0}
    )
    args = Namespace(threads=1, peers=False, out=tmp_path / "quality", commit="abc1234")
    quality.report([ours, theirs], args, _tasks())
    assert quality.load_rows(tmp_path / "quality.json") == [ours]  # kvpress rows are re-scored, not read

    def runs(*pairs):
        return {"runs": [{"press": p, "rate": r, "outputs": {}, "perplexity": x, "seconds": 1.0} for p, r, x in pairs]}

    (tmp_path / "a.json").write_text(json.dumps(runs(("none", 0.0, 9.0), ("SnapKV", 0.6, 9.5))))
    (tmp_path / "b.json").write_text(json.dumps(runs(("none", 0.0, 9.1), ("TOVA", 0.6, 9.7), ("SnapKV", 0.6, 1.0))))
    merged = quality.read_peers([tmp_path / "a.json", tmp_path / "b.json"])
    assert [(s.label, run["perplexity"]) for s, run in merged] == [
        ("kvpress uncompressed", 9.0),
        ("kvpress SnapKV", 9.5),
        ("kvpress TOVA", 9.7),
    ]


def test_the_confidence_ablation_sets_dynamics_doubt_weight():
    from confkv.compress.config import CompressionConfig, resolve

    plan = RunFile.load(RUNS / "confidence.yaml").plan()
    ablation = [s for s in plan if s.doubt_weight is not None]
    assert [s.label for s in ablation] == [f"dynamic, doubt_weight {w}" for w in ("+0.5", "+0", "-0.5")]
    weights = [resolve(CompressionConfig(), quality.request_of(s), True, False).scorer().doubt_weight for s in ablation]
    assert weights == [0.5, 0.0, -0.5] and {s.rate for s in ablation} == {0.9}
    as_shipped = Setup("dynamic", "int8", "dynamic", 0.9)
    assert resolve(CompressionConfig(), quality.request_of(as_shipped), True, False).scorer().doubt_weight == 0.5


def test_the_lookahead_rows_ask_the_server_to_look_ahead():
    from confkv.compress.config import CompressionConfig, resolve

    run = RunFile.model_validate(
        {
            "rates": [0.95],
            "setups": [
                {"label": "dynamic"},
                {"label": "dynamic, lookahead 8", "lookahead": 8},
                {"label": "dynamic, lookahead 16", "lookahead": 16},
            ],
        }
    )
    plan = run.plan()
    asked = [resolve(CompressionConfig(), quality.request_of(s), True, False).lookahead_tokens for s in plan]
    assert asked == [0, 0, 8, 16]  # uncompressed, dynamic as shipped, then the two rows


def test_a_run_file_plans_uncompressed_first_then_each_rate_and_refuses_what_it_does_not_know():
    run = RunFile.model_validate(
        {
            "rates": [0.6, 0.9],
            "setups": [
                {"label": "uniform int4", "policy": "none", "storage": "int4"},
                {"label": "dynamic"},
                {"label": "dynamic, rate only", "thresholds_decide": False, "rates": [0.75]},
            ],
        }
    )
    plan = [(s.label, s.rate) for s in run.plan()]
    assert plan == [
        ("uncompressed", 0.0),
        ("uniform int4", 0.0),  # compresses nothing: once
        ("dynamic", 0.6),
        ("dynamic", 0.9),
        ("dynamic, rate only", 0.75),  # its own rates
    ]
    assert run.tasks.needles == 9 and run.peers is None  # the defaults: the usual cases, no kvpress
    with pytest.raises(ValidationError, match="poolings"):
        RunFile.model_validate({"setups": [{"label": "x", "poolings": ["max:3"]}]})
    with pytest.raises(ValidationError, match="needles"):
        RunFile.model_validate({"tasks": {"needles": -1}})
    with pytest.raises(ValidationError, match="rate: set by the run"):
        RunFile.model_validate({"setups": [{"label": "x", "rate": 0.5}]})
    with pytest.raises(ValidationError, match="thresholds"):
        RunFile.model_validate({"setups": [{"label": "x", "thresholds": "high"}]})


@pytest.mark.parametrize("path", sorted(RUNS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_run_file_is_valid_and_its_results_are_where_the_book_finds_them(path):
    run = RunFile.load(path)
    plan = run.plan()
    assert plan[0].label == "uncompressed" and len({(s.label, s.rate) for s in plan}) == len(plan)
    name = "quality" if path.stem == "default" else f"quality_{path.stem}"
    assert (RUNS.parent / "results" / f"{name}.json").is_file(), f"{path.name}: no results file {name}.json"


def test_long_answers_run_their_length_in_full(default_model, tokenizer):
    """The model-confidence ablation's answers: every summary exactly as long as asked, EOS ignored,
    so generated tokens leave the protected recent window."""
    tasks = quality.build_tasks(tokenizer, 0, 1, 600, answer_tokens=40)
    assert tasks.max_tokens == {"summary-0": 40} and tasks.ignore_eos == {"summary-0"}
    _, tokens, _, _ = quality.run_setup(
        default_model, tokenizer, Setup("uncompressed", "auto", "none", 0.0), tasks, None
    )
    assert len(tokens["summary-0"]) == 40
    assert quality.build_tasks(tokenizer, 0, 1, 600).ignore_eos == set()  # as shipped: up to 48, EOS ends them


def test_kivi_quantises_keys_per_channel_and_values_per_token_within_half_a_step():
    from benchmarks import kivi

    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    x[..., 5] *= 20  # an outlier channel, as keys have
    for dim in (2, 3):  # keys: groups of tokens per channel; values: groups of channels per token
        got = kivi.fake_quantize(x, 2, dim)
        groups = x.movedim(dim, -1).unflatten(-1, (-1, kivi.GROUP))
        step = (groups.amax(-1) - groups.amin(-1)) / 3  # 2 bits: 4 levels
        error = (got - x).abs().movedim(dim, -1).unflatten(-1, (-1, kivi.GROUP)).amax(-1)
        assert bool((error <= step / 2 + 1e-2 * step + 1e-3).all())
        assert len(torch.unique(got.movedim(dim, -1).unflatten(-1, (-1, kivi.GROUP))[0, 0, 0, 0])) <= 4
    # Per channel, the outlier channel's range does not spread to the others: keys fare far better so.
    keys_error = (kivi.fake_quantize(x, 2, dim=2) - x)[..., :5].abs().mean()
    tokens_error = (kivi.fake_quantize(x, 2, dim=3) - x)[..., :5].abs().mean()
    assert keys_error < tokens_error / 3
    assert kivi.memory_kept(4160, 2, 32) == pytest.approx((4128 * 3 + 32 * 32) / (4160 * 32))  # 32 in the residual


def test_kivi_at_full_width_answers_as_the_model_does(default_model, tokenizer):
    """The cache surgery is exact: at 16 bits KIVI's answer is the model's own greedy answer."""
    from benchmarks import kivi

    prompt = tokenizer(" ".join(f"Item {i} is filed under box {i % 7}." for i in range(40))).input_ids[:200]
    with torch.inference_mode():
        want = default_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 200:]
    answers = kivi.generate(default_model, prompt, [16, 2], 12)
    assert answers[16] == want.tolist()
    assert answers[2] != answers[16]  # 2 bits on this model moves the answer


def test_the_long_run_puts_every_row_at_the_frontier(monkeypatch, tokenizer):
    from confkv.compress.config import CompressionConfig, resolve

    monkeypatch.setattr(sys, "argv", ["run.py", str(RUNS / "long.yaml"), "--threads", "1"])
    args = quality.parse_args()
    assert args.needles == 12 and args.needle_lengths == [4000, 7000] and not args.forced
    assert args.peers and args.peers_after and args.presses == ["SnapKV", "AdaKV(SnapKV)"]  # per-head budgets
    assert args.out == RUNS.parent / "results" / "quality_long" and "benchmarks/quality/runs/long.yaml" in (
        args.provenance.measures
    )
    plan = args.run.plan()
    labels = {s.label for s in plan}
    assert {"uncompressed", "uniform kivi4", "KIVI-2", "KIVI-4", "dynamic", "dynamic, kivi4", "tova, int8"} <= labels
    assert {"snapkv, int8", "dynamic, pyramid layers", "dynamic, adaptive layers"} <= labels
    assert {s.key_only_bits for s in plan if s.label == "dynamic, 2-bit KEY_ONLY values"} == {2}
    assert {s.storage for s in plan if s.label.startswith("dynamic, kivi4")} == {"kivi4"}
    assert {s.rate for s in plan if s.rate} == {0.875, 0.95, 0.97}
    previous = next(s for s in plan if s.label == "dynamic, max-pooled over 3")  # dynamic's earlier default
    scorer = resolve(CompressionConfig(), quality.request_of(previous), True, False).scorer()
    assert (scorer.pooling, scorer.kernel_size) == ("max", 3)
    assert {s.rate for s in plan if s.label == "dynamic, rate only"} == {0.875, 0.95, 0.97}
    assert {s.lookahead for s in plan if s.label == "dynamic, lookahead 16"} == {16}
    rate_only_previous = [s for s in plan if s.label == "dynamic, rate only, max-pooled over 3"]
    assert {s.rate for s in rate_only_previous} == {0.875, 0.95, 0.97}
    options = quality.request_of(rate_only_previous[0])["policy_options"]["dynamic"]
    assert options == {"thresholds_decide": False, "pooling": "max", "kernel_size": 3}
    pyramid = next(s for s in plan if s.layer_budget == "pyramid")
    assert resolve(CompressionConfig(), quality.request_of(pyramid), True, False).layer_budget == "pyramid"
    tasks = quality.build_tasks(tokenizer, 2, 0, 0, needle_lengths=(4000, 7000))
    assert [c.context_tokens for c in tasks.needles] == [4000, 7000] and tasks.perplexity_ids == []
    assert 3900 < len(tasks.prompts["needle-4000-0"]) < 4400 and 6800 < len(tasks.prompts["needle-7000-1"]) < 7700
    held_out = quality.build_tasks(tokenizer, 2, 0, 0, needle_lengths=(4000, 7000), first_needle=12)
    assert [c.name for c in held_out.needles] == ["needle-4000-12", "needle-7000-13"]
    assert not set(held_out.prompts) & set(tasks.prompts)
    row = Row(Setup("uncompressed", "auto", "none", 0.0), needle_relative=1.0)
    assert set(quality.measured_tasks([row])) == {"needle"}


def test_a_shared_engine_takes_prompts_from_the_prefix_cache_and_keeps_what_a_fresh_one_keeps(default_model, tokenizer):
    """The benchmark runs the setups of one storage on one engine: later setups reuse the prompts,
    all but the tokens their compression observes, and answer exactly and keep alike as on a fresh engine."""
    tasks = quality.build_tasks(tokenizer, 2, 0, 0, needle_lengths=(400,))
    first, second = Setup("tova", "int8", "tova", 0.9), Setup("dynamic", "int8", "dynamic", 0.9)
    engine = quality.new_engine(default_model, tokenizer, None)
    quality.run_setup(default_model, tokenizer, first, tasks, None, engine)
    shared = quality.run_setup(default_model, tokenizer, second, tasks, None, engine)
    fresh = quality.run_setup(default_model, tokenizer, second, tasks, None)
    assert shared[1] == fresh[1]  # the same answers, token for token
    for name, metrics in shared[2].items():
        assert metrics["hit_rate"] > 0.8 and fresh[2][name]["hit_rate"] == 0.0
        # What each tier holds: the same entries in all, split alike. The split between KEY_ONLY and
        # dropped weighs the scores' sizes (`tiers._spend`), which the two prefills give up to rounding.
        held, want = metrics["entries"], fresh[2][name]["entries"]
        total = sum(want.values())
        assert sum(held.values()) == total
        assert all(abs(held[tier] - want[tier]) <= 0.002 * total for tier in want), (held, want)
