"""Collect predictor traces: the model runs with an uncompressed cache while every decode step's
attention on every cached entry is recorded; each recording becomes (window, target) samples.

The samples follow the observation timeline the serving engine sees: at the end of prefill, the
last prompt queries spaced `score_interval` apart; then one decode query every `score_interval`
steps. An entry's window is its features at the last `observation_steps` observations; its target
the attention it receives over the next `prediction_window` decode steps (every step counts).
Prompts come from text that ships with Python: long documents with a question, multi-turn chats
and free continuations.

    python -m confkv.compress.predictor.collect --out traces/ --sequences 24
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from confkv.compress.config import CompressionConfig, resolve
from confkv.compress.predictor.features import target, window_features
from confkv.compress.predictor.model import PredictorConfig
from confkv.compress.scoring import make_policy
from confkv.engine.llm_engine import EngineConfig, LLMEngine
from confkv.engine.sequence import SamplingParams
from confkv.models.corpus import paragraphs
from confkv.models.loader import load_model

SAMPLE_TENSORS = ("windows", "targets", "accumulated", "groups", "at_prefill", "held", "decayed_total")


@dataclass
class Recording:
    """Per layer: the prompt's observed queries [queries, prompt_len] and every decode step's mass."""

    prefill: list[torch.Tensor | None]
    masses: list[list[torch.Tensor]]
    confidences: list[float] = field(default_factory=list)  # top-token probability of each generated token
    prompt_len: int = 0
    key_norms: list[torch.Tensor] = field(default_factory=list)  # per layer [entries], mean over heads


def record(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[Recording]:
    """Run `prompts` through `engine` (which must observe every step and drop nothing)."""
    num_layers = engine.store.num_layers
    recordings: dict[int, Recording] = {}

    def record_rows(seq_id: int, layer: int, rows: torch.Tensor) -> None:
        rec = recordings[seq_id]
        if rec.prefill[layer] is None:
            rec.prefill[layer] = rows.detach().float().cpu().clone()
        else:
            rec.masses[layer].append(rows[-1].detach().float().cpu().clone())

    def record_confidences(confidence: dict[int, float]) -> None:
        for seq_id, value in confidence.items():
            recordings[seq_id].confidences.append(value)

    hooks = engine.compression.hooks
    hooks.observed.append(record_rows)
    hooks.sampled.append(record_confidences)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    params = resolve(
        engine.compression_config, {"policy": "h2o", "compression_rate": 0.0, "kv_cache_dtype": "auto"}, True, False
    )
    for i, prompt in enumerate(prompts):
        seq = engine.add_request(f"trace-{i}", prompt, sampling, params)
        recordings[seq.seq_id] = Recording([None] * num_layers, [[] for _ in range(num_layers)], prompt_len=len(prompt))
    key_norms: dict[int, list[torch.Tensor]] = {}
    with torch.inference_mode(), tqdm(total=len(prompts), desc="recording attention", unit="sequence") as bar:
        while engine.has_unfinished():
            running = list(engine.scheduler.running)
            for seq in running:  # keys are read before a sequence finishes and its cache goes
                key_norms[seq.seq_id] = [
                    engine.store.view(seq.seq_id, layer).keys.float().norm(dim=-1).mean(0).cpu()
                    for layer in range(num_layers)
                ]
            bar.update(sum(out.finished for out in engine.step()))
    hooks.observed.remove(record_rows)
    hooks.sampled.remove(record_confidences)
    for seq_id, rec in recordings.items():
        rec.key_norms = key_norms[seq_id]
    return list(recordings.values())


def samples(
    rec: Recording, config: PredictorConfig, every: int, decay: float, stride: int, per_step: int, rng: random.Random
) -> dict[str, torch.Tensor]:
    """Samples of one recording: `windows` [n, T, F] and `targets` [n] to train on, plus what the
    offline comparison with attention-only scorers needs: `accumulated` [n] (attention summed over
    every observation, H2O's score), `groups` [n] (the samples of one layer at one observation
    share a group: scorers are compared by what they keep within it) and `at_prefill` [n] (the
    observation is the end of prefill, where the largest share of entries is dropped).

    `every` is the serving engine's score_interval and `decay` the dynamic policy's; a sample is
    taken at every `stride`-th observation, for `per_step` random entries of the layer.
    """
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in SAMPLE_TENSORS}
    for layer in range(len(rec.masses)):
        timeline = _timeline(rec, layer, config, every)
        if timeline is not None:
            _sample_layer(timeline, config, decay, stride, per_step, rng, parts)
    if not parts["windows"]:
        window = config.prediction_window
        raise ValueError(f"no samples: a recording needs more than prediction_window ({window}) decode steps")
    return {name: torch.cat(tensors).contiguous() for name, tensors in parts.items()}


@dataclass
class _Timeline:
    """One layer of a recording as the serving engine observes it, over all `total` entries."""

    layer: int
    num_layers: int
    masses: torch.Tensor  # [observations, total]: the last prompt queries', then each observed decode step's
    queries: torch.Tensor  # [observations] those queries' positions
    observed: list[int]  # the decode steps observed
    cumulative: torch.Tensor  # [decode steps + 1, total] decode attention summed: window sums by difference
    prefill_sum: torch.Tensor  # [total] every prompt query's attention summed: where accumulated scores start
    key_norm: torch.Tensor  # [total]
    confidence: torch.Tensor  # [total] top-token probability of each entry's token (1 for the prompt)

    @property
    def num_decode(self) -> int:
        return len(self.cumulative) - 1


def _timeline(rec: Recording, layer: int, config: PredictorConfig, every: int) -> _Timeline | None:
    """The layer's observations every `every` steps; None if it has no complete prediction window."""
    steps = config.observation_steps
    prefill, decode, prompt_len = rec.prefill[layer], rec.masses[layer], rec.prompt_len
    if prefill is None or len(decode) <= config.prediction_window:
        return None
    rows = [prefill.shape[0] - 1 - every * (steps - 1 - r) for r in range(steps)]
    if rows[0] < 0:
        raise ValueError("observation_window must cover observation_steps x score_interval prompt queries")
    total = prompt_len + len(decode)
    observed = list(range(0, len(decode), every))  # decode steps the serving engine observes
    dense = torch.zeros(len(decode), total)
    for j, mass in enumerate(decode):
        dense[j, : len(mass)] = mass
    masses = torch.zeros(steps + len(observed), total)
    masses[:steps, : prefill.shape[1]] = prefill[rows]
    masses[steps:] = dense[observed]
    queries = torch.tensor([prompt_len - 1 - every * (steps - 1 - r) for r in range(steps)])
    prefill_sum = torch.zeros(total)
    prefill_sum[: prefill.shape[1]] = prefill.sum(0)
    key_norm = torch.zeros(total)
    key_norm[: len(rec.key_norms[layer])] = rec.key_norms[layer][:total]
    confidence = torch.ones(total)
    generated = torch.tensor(rec.confidences[: total - prompt_len])
    confidence[prompt_len : prompt_len + len(generated)] = generated
    return _Timeline(
        layer=layer,
        num_layers=len(rec.masses),
        masses=masses,
        queries=torch.cat((queries, prompt_len + torch.tensor(observed))),
        observed=observed,
        cumulative=torch.cat((torch.zeros(1, total), dense.cumsum(0))),
        prefill_sum=prefill_sum,
        key_norm=key_norm,
        confidence=confidence,
    )


def _sample_layer(
    timeline: _Timeline,
    config: PredictorConfig,
    decay: float,
    stride: int,
    per_step: int,
    rng: random.Random,
    parts: dict[str, list[torch.Tensor]],
) -> None:
    """Append to `parts` one group of samples per `stride`-th observation whose window is complete."""
    steps, window, tl = config.observation_steps, config.prediction_window, timeline
    decayed = accumulated = tl.prefill_sum
    for i in range(steps - 1, len(tl.masses)):
        if i >= steps:
            decayed = decay * decayed + tl.masses[i]
            accumulated = accumulated + tl.masses[i]
        first = 0 if i < steps else tl.observed[i - steps] + 1  # the first decode step after this query
        if first + window > tl.num_decode:
            break
        if (i - steps + 1) % stride:
            continue
        present = int(tl.queries[i]) + 1  # the query sees entries up to its own position
        chosen = torch.tensor(sorted(rng.sample(range(present), min(per_step, present))))
        span = slice(i - steps + 1, i + 1)
        parts["windows"].append(
            window_features(
                tl.masses[span][:, chosen],
                decayed[chosen],
                chosen,
                tl.queries[span],
                tl.confidence[chosen],
                tl.key_norm[chosen],
                tl.layer,
                tl.num_layers,
            )
        )
        parts["targets"].append(target(tl.cumulative[first + window, chosen] - tl.cumulative[first, chosen]))
        parts["accumulated"].append(accumulated[chosen])
        n = len(chosen)
        parts["groups"].append(torch.full((n,), len(parts["groups"])))  # one group per (layer, observation)
        parts["at_prefill"].append(torch.full((n,), i < steps))
        parts["held"].append(torch.full((n,), present))
        parts["decayed_total"].append(torch.full((n,), float(decayed[:present].sum())))


@dataclass(frozen=True)
class TraceSize:
    """How much a collection records (`make collect-traces`' defaults)."""

    sequences: int = 24
    prompt_tokens: int = 800
    max_tokens: int | None = None  # decode steps per sequence (None: 2.5 x the prediction window, 320 for 128)
    stride: int = 3  # observations between samples
    entries_per_step: int = 48

    def decode_steps(self, prediction_window: int) -> int:
        return self.max_tokens or prediction_window * 5 // 2


def corpus_prompts(tokenizer, sequences: int, prompt_tokens: int) -> list[list[int]]:
    """Prompts from the built-in corpus, in turn a question about a document, a chat asking for a
    summary, and a free continuation."""
    texts = paragraphs()
    prompts = []
    for i in range(sequences):
        document = " ".join(texts[(7 * i + j) % len(texts)] for j in range(12))
        ids = tokenizer(document).input_ids[:prompt_tokens]
        kind = i % 3
        if kind < 2 and tokenizer.chat_template:
            question = "What is the text above about?" if kind == 0 else "Summarise this for a colleague."
            messages = [{"role": "user", "content": tokenizer.decode(ids) + "\n\n" + question}]
            chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(chat, add_special_tokens=False).input_ids
        prompts.append(ids)
    return prompts


def collect(
    model, tokenizer, config: PredictorConfig, size: TraceSize, serving: CompressionConfig | None = None, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """Record `size.sequences` corpus prompts on `model` with an uncompressed cache observed at every
    step, and turn each recording into samples for `config`'s window (one dict per sequence). The
    observation timeline is the one `serving` (the server's compression config) will follow."""
    max_tokens = size.decode_steps(config.prediction_window)
    if max_tokens <= config.prediction_window:
        raise ValueError(
            f"max_tokens ({max_tokens}) must exceed prediction_window ({config.prediction_window}): a sample's "
            "target is the attention over the window that follows it"
        )
    serving = serving or CompressionConfig.load()
    recording = serving.model_copy(update={"score_interval": 1, "compression_interval": 10**6})
    engine_config = EngineConfig(max_cache_bytes=2**32, max_num_seqs=8)
    engine = LLMEngine(model, tokenizer, engine_config, recording, calibrations={})  # nothing is dropped: none needed
    decay = make_policy("dynamic", serving.policy_options.get("dynamic")).decay
    rng = random.Random(seed)
    prompts = corpus_prompts(tokenizer, size.sequences, size.prompt_tokens)
    return [
        samples(rec, config, serving.score_interval, decay, size.stride, size.entries_per_step, rng)
        for rec in record(engine, prompts, max_tokens)
    ]


def main() -> None:
    defaults = TraceSize()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sequences", type=int, default=defaults.sequences)
    parser.add_argument("--prompt-tokens", type=int, default=defaults.prompt_tokens)
    parser.add_argument("--max-tokens", type=int, default=None, help="default: 2.5 x the prediction window")
    parser.add_argument("--stride", type=int, default=defaults.stride, help="observations between samples")
    parser.add_argument("--entries-per-step", type=int, default=defaults.entries_per_step)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    size = TraceSize(args.sequences, args.prompt_tokens, args.max_tokens, args.stride, args.entries_per_step)
    model, tokenizer = load_model(args.model_path, torch.device("cpu"))
    args.out.mkdir(parents=True, exist_ok=True)
    for i, tensors in enumerate(collect(model, tokenizer, PredictorConfig.load(), size)):
        save_file(tensors, str(args.out / f"trace-{i:03d}.safetensors"))


if __name__ == "__main__":
    main()
