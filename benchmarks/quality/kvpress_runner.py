"""NVIDIA kvpress presses on the quality benchmark's own cases, in kvpress's own environment.

kvpress 0.5.5 needs transformers < 5.3, so it cannot share the server's environment: `make bench-peers`
builds `.venv-peers` and `benchmarks/quality/run.py --peers` runs this script there. It reads the cases that
quality.py wrote (chat messages, token budgets, the perplexity text), runs every press at every rate and
writes the raw outputs; quality.py scores them exactly as it scores our own policies.

- Needles and summaries, query-aware, as kvpress's pipeline does it: the whole user message (document and
  question) is prefilled and compressed with `compression_ratio` = our `compression_rate`, then the chat
  template's assistant header and greedy decoding follow (the pipeline's own `generate_answer`).
  A press compresses each layer's cache after that layer's attention, which the prefill never reads
  again, so one uncompressed prefill per case serves every press and rate: at each layer every press's
  own hook runs on its own copy of the layer. The first case of every press also runs through kvpress's
  pipeline, and a different answer stops the run.
- Perplexity: the text is teacher-forced one token at a time after an uncompressed prefill (shared), the
  press wrapped in `CompressionRatioDecodingPress` so that it keeps the same fraction of every token seen
  so far, compressing every `compression_interval` tokens as our engine does.

    .venv-peers/bin/python benchmarks/quality/kvpress_runner.py --cases cases.json --out peers.json --rates 0.6
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from kvpress import (
    AdaKVPress,
    CompressionRatioDecodingPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    KVPressTextGenerationPipeline,
    ObservedAttentionPress,
    ScorerPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

PRESSES: dict[str, Callable[[float], ScorerPress | AdaKVPress]] = {
    "SnapKV": lambda r: SnapKVPress(compression_ratio=r),
    "AdaKV(SnapKV)": lambda r: AdaKVPress(SnapKVPress(compression_ratio=r)),  # the same scores, budgets per head
    "ExpectedAttention": lambda r: ExpectedAttentionPress(compression_ratio=r),
    "AdaKV(ExpectedAttention)": lambda r: AdaKVPress(ExpectedAttentionPress(compression_ratio=r)),
    "TOVA": lambda r: TOVAPress(compression_ratio=r),
    "KeyDiff": lambda r: KeyDiffPress(compression_ratio=r),
    "StreamingLLM": lambda r: StreamingLLMPress(compression_ratio=r),
    "Knorm": lambda r: KnormPress(compression_ratio=r),
    "ObservedAttention": lambda r: ObservedAttentionPress(compression_ratio=r),
}
UNCOMPRESSED = "none"
NEEDS_EAGER = {"ObservedAttention"}  # scores from the attention weights, which only eager attention returns
Setup = tuple[str, float]  # (press, rate)


def make_press(setup: Setup) -> ScorerPress | AdaKVPress | None:
    name, rate = setup
    return None if name == UNCOMPRESSED else PRESSES[name](rate)


def load(model_path: str, eager: bool) -> KVPressTextGenerationPipeline:
    config = AutoConfig.from_pretrained(model_path)
    if getattr(config, "quantization_config", "absent") is None:
        del config.quantization_config  # newer transformers write `null`; this one reads it as quantised
    model = AutoModelForCausalLM.from_pretrained(
        model_path, config=config, dtype=torch.float32, attn_implementation="eager" if eager else "sdpa"
    ).eval()
    return KVPressTextGenerationPipeline(model=model, tokenizer=AutoTokenizer.from_pretrained(model_path))


@torch.inference_mode()
def answers(pipe: KVPressTextGenerationPipeline, case: dict, setups: list[Setup]) -> dict[Setup, str]:
    """Every setup's answer to one case from one uncompressed prefill (see the module's docstring)."""
    model = pipe.model
    inputs = pipe.preprocess(case["messages"][-1]["content"], [""], "", pipe.tokenizer.model_max_length)
    context_ids, question_ids = inputs["context_ids"], inputs["questions_ids"][0]
    presses = {setup: make_press(setup) for setup in setups}
    caches = {setup: DynamicCache() for setup in setups}
    masks: dict[Setup, dict[int, tuple | None]] = {setup: {} for setup in setups}  # AdaKV's per-head masks
    attention = [layer.self_attn for layer in model.model.layers]
    for module in attention:
        module.rotary_emb = model.model.rotary_emb  # as a press's context manager sets it
    for press in presses.values():
        if press is not None:
            press.post_init_from_model(model)

    def fan_out(module, args, kwargs, output):
        layer = module.layer_idx
        uncompressed = kwargs["past_key_values"].layers[layer]
        for setup, press in presses.items():
            caches[setup].update(uncompressed.keys, uncompressed.values, layer)
            if press is not None:
                module.masked_key_indices = None
                press.forward_hook(module, args, {**kwargs, "past_key_values": caches[setup]}, output)
                masks[setup][layer] = getattr(module, "masked_key_indices", None)
        return output

    hooks = [module.register_forward_hook(fan_out, with_kwargs=True) for module in attention]
    try:
        model.model(input_ids=context_ids, past_key_values=DynamicCache())
    finally:
        for hook in hooks:
            hook.remove()
    out = {}
    for setup in setups:
        set_head_masks(model, masks[setup])
        out[setup] = pipe.generate_answer(question_ids, caches.pop(setup), context_ids.shape[1], case["max_tokens"])
    set_head_masks(model, {})
    return out


def set_head_masks(model, masks: dict[int, tuple | None]) -> None:
    """AdaKV's per-head masks on the attention layers (kvpress keeps them there), none where not given.
    kvpress's prefill clears them; a cache that did not come from one must set them itself."""
    for layer, block in enumerate(model.model.layers):
        block.self_attn.masked_key_indices = masks.get(layer)


def pipeline_answer(pipe: KVPressTextGenerationPipeline, case: dict, setup: Setup) -> str:
    content = case["messages"][-1]["content"]
    return pipe(content, press=make_press(setup), max_new_tokens=case["max_tokens"])["answer"]


@torch.inference_mode()
def perplexity(model, spec: dict, setups: list[Setup], position: int) -> dict[Setup, float]:
    """exp(mean NLL) of the text's last tokens, teacher-forced one at a time, compressed as it goes, per setup."""
    ids, prefill, interval = spec["token_ids"], spec["prefill"], spec["interval"]
    tokens = torch.tensor([ids])
    prefilled = DynamicCache()
    first = model(input_ids=tokens[:, :prefill], past_key_values=prefilled).logits[0, -1]
    result = {}
    for setup in tqdm(setups, desc="kvpress perplexity", unit="setup", position=position, leave=False):
        cache, logits, nll = copy.deepcopy(prefilled), first, 0.0
        set_head_masks(model, {})  # the previous setup's, if it was AdaKV
        press = make_press(setup)
        decoding = (
            CompressionRatioDecodingPress(
                press, compression_interval=interval, target_compression_ratio=press.compression_ratio
            )
            if press is not None
            else None
        )
        with decoding(model) if decoding else contextlib.nullcontext():
            for pos in range(prefill, len(ids)):
                nll -= torch.log_softmax(logits.float(), -1)[ids[pos]].item()
                if pos + 1 < len(ids):
                    step, position_ids = tokens[:, pos : pos + 1], torch.tensor([[pos]])
                    logits = model(input_ids=step, past_key_values=cache, position_ids=position_ids).logits[0, -1]
        result[setup] = math.exp(nll / (len(ids) - prefill))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=Path, required=True, help="written by benchmarks/quality/run.py")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--presses", nargs="+", default=list(PRESSES), choices=list(PRESSES))
    parser.add_argument("--rates", type=float, nargs="+", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--position", type=int, default=0, help="progress bars' first line (below a caller's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = json.loads(args.cases.read_text())
    cases, ppl = spec["cases"], spec["perplexity"]

    # kvpress's own uncompressed run first: presses are scored against it, so that a difference between
    # the two transformers versions is not counted against them.
    plan = [(UNCOMPRESSED, 0.0)] + [(press, rate) for press in args.presses for rate in args.rates]
    groups = {eager: [s for s in plan if (s[0] in NEEDS_EAGER) == eager] for eager in (False, True)}
    outputs: dict[Setup, dict[str, str]] = {setup: {} for setup in plan}
    perplexities: dict[Setup, float] = {}
    seconds: dict[bool, float] = {}
    for eager, group in groups.items():
        if not group:
            continue
        pipe = load(spec["model_path"], eager)
        started = time.perf_counter()
        label = f"kvpress, {len(group)} setups, " + ("eager" if eager else "sdpa")
        for case in tqdm(cases, desc=label, unit="case", position=args.position):
            for setup, text in answers(pipe, case, group).items():
                outputs[setup][case["name"]] = text
        seconds[eager] = time.perf_counter() - started
        check_against_pipeline(pipe, cases[0], group, outputs)
        if ppl["token_ids"]:  # the long-context preset has no perplexity task
            perplexities |= perplexity(pipe.model, ppl, group, args.position)
    runs = [
        {
            "press": name,
            "rate": rate,
            "outputs": outputs[(name, rate)],
            "perplexity": perplexities.get((name, rate)),
            "seconds": seconds[name in NEEDS_EAGER] / len(groups[name in NEEDS_EAGER]),  # the group's, shared
        }
        for name, rate in plan
    ]
    for run in (r for r in runs if r["perplexity"] is not None):
        tqdm.write(f"{run['press']:26s} rate {run['rate']:.2f}  perplexity {run['perplexity']:.2f}")
    args.out.write_text(json.dumps({"runs": runs}, indent=1))


def check_against_pipeline(
    pipe: KVPressTextGenerationPipeline, case: dict, setups: list[Setup], outputs: dict[Setup, dict[str, str]]
) -> None:
    """Each press's first setup, on the first case, through kvpress's own pipeline: the same answer or stop."""
    first = {name: (name, rate) for name, rate in reversed(setups)}
    for setup in first.values():
        expected = pipeline_answer(pipe, case, setup)
        if outputs[setup][case["name"]] != expected:
            raise SystemExit(
                f"{setup[0]} at {setup[1]} on {case['name']}: the shared prefill answered "
                f"{outputs[setup][case['name']]!r}, kvpress's pipeline {expected!r}. This kvpress compresses "
                "differently from what this runner assumes (see its docstring); update the runner."
            )
    tqdm.write(f"kvpress's pipeline gives the shared prefill's answers on {case['name']} ({', '.join(first)})")


if __name__ == "__main__":
    main()
