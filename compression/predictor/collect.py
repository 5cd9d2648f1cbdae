"""Collect predictor traces: the model runs with an uncompressed cache while every decode step's
attention on every cached entry is recorded; each recording becomes (window, target) samples.

For an observation k of layer l, an entry's window is its features at observations k-T+1..k and
its target the attention it receives over observations k+1..k+W (T = observation_steps,
W = prediction_window). Prompts come from text that ships with Python: long documents with a
question, multi-turn chats and free continuations.

    python -m compression.predictor.collect --out traces/ --sequences 24
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from app.engine import EngineConfig, LLMEngine
from app.sequence import SamplingParams
from compression.config import CompressionConfig, resolve
from compression.predictor.features import entry_features, target
from compression.predictor.model import PredictorConfig

DECAY = 0.95  # as the dynamic policy's attention_decay


@dataclass
class Recording:
    """Per layer, the attention mass [entries] of every decode-step observation of one sequence."""

    masses: list[list[torch.Tensor]]
    confidences: list[float] = field(default_factory=list)  # top-token probability of each generated token
    prompt_len: int = 0
    key_norms: list[torch.Tensor] = field(default_factory=list)  # per layer [entries], mean over heads


def record(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[Recording]:
    """Run `prompts` through `engine` (which must observe every step and drop nothing)."""
    num_layers = engine.store.num_layers
    recordings: dict[int, Recording] = {}
    seen_prefill: set[tuple[int, int]] = set()
    observe = engine.compression.on_attention

    def recording_observer(seq_id: int, layer: int, mass: torch.Tensor) -> None:
        observe(seq_id, layer, mass)
        if (seq_id, layer) in seen_prefill:  # the end-of-prefill observation sums many queries: skip it
            recordings[seq_id].masses[layer].append(mass.detach().float().cpu().clone())
        seen_prefill.add((seq_id, layer))

    after_step = engine.compression.after_step

    def recording_after_step(sequences, confidence: dict[int, float]) -> float:
        for seq_id, value in confidence.items():
            recordings[seq_id].confidences.append(value)
        return after_step(sequences, confidence)

    engine.compression.on_attention = recording_observer
    engine.compression.after_step = recording_after_step
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    params = resolve(
        engine.compression_config, {"policy": "h2o", "compression_rate": 0.0, "kv_cache_dtype": "auto"}, True, False
    )
    for i, prompt in enumerate(prompts):
        seq = engine.add_request(f"trace-{i}", prompt, sampling, params)
        recordings[seq.seq_id] = Recording([[] for _ in range(num_layers)], prompt_len=len(prompt))
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
    engine.compression.on_attention = observe
    engine.compression.after_step = after_step
    for seq_id, rec in recordings.items():
        rec.key_norms = key_norms[seq_id]
    return list(recordings.values())


def samples(rec: Recording, config: PredictorConfig, stride: int, per_step: int, rng: random.Random):
    """(windows [n, T, F], targets [n]) from one recording."""
    steps, window = config.observation_steps, config.prediction_window
    num_layers = len(rec.masses)
    windows, targets = [], []
    for layer, masses in enumerate(rec.masses):
        if len(masses) < steps + window:
            continue
        total = len(masses[-1])  # the last observation saw every entry
        key_norm = torch.zeros(total)  # read before the last step: entries chosen below are all covered
        key_norm[: len(rec.key_norms[layer])] = rec.key_norms[layer][:total]
        confidence = torch.ones(total)
        generated = torch.tensor(rec.confidences[: total - rec.prompt_len])
        confidence[rec.prompt_len : rec.prompt_len + len(generated)] = generated
        padded = torch.zeros(len(masses), total)  # observation j saw entries 0..len(masses[j])-1
        for j, m in enumerate(masses):
            padded[j, : len(m)] = m
        decayed = torch.zeros_like(padded)
        running = torch.zeros(total)
        for j in range(len(masses)):
            running = DECAY * running + padded[j]
            decayed[j] = running
        for k in range(steps - 1, len(masses) - window, stride):
            entries = len(masses[k - steps + 1])  # present in the whole window
            chosen = torch.tensor(sorted(rng.sample(range(entries), min(per_step, entries))))
            future = padded[k + 1 : k + 1 + window, chosen].sum(0)
            rows = []
            for j in range(k - steps + 1, k + 1):
                query = len(masses[j])  # the observing query's position
                rows.append(
                    entry_features(
                        padded[j, chosen],
                        decayed[j, chosen],
                        chosen,
                        query,
                        confidence[chosen],
                        key_norm[chosen],
                        layer,
                        num_layers,
                    )
                )
            windows.append(torch.stack(rows, dim=1))
            targets.append(target(future))
    if not windows:
        return torch.empty(0, steps, len(config.features)), torch.empty(0)
    return torch.cat(windows), torch.cat(targets)


def main() -> None:
    from benchmarks.corpus import paragraphs
    from models.loader import load_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sequences", type=int, default=24)
    parser.add_argument("--prompt-tokens", type=int, default=800)
    parser.add_argument("--max-tokens", type=int, default=320)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--entries-per-step", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = PredictorConfig.load()
    model, tokenizer = load_model(args.model_path, torch.device("cpu"))
    texts = paragraphs()
    prompts = []
    for i in range(args.sequences):
        document = " ".join(texts[(7 * i + j) % len(texts)] for j in range(12))
        ids = tokenizer(document).input_ids[: args.prompt_tokens]
        kind = i % 3  # a question about the document, a chat, or a free continuation
        if kind < 2:
            question = "What is the text above about?" if kind == 0 else "Summarise this for a colleague."
            text = tokenizer.decode(ids) + "\n\n" + question
            messages = [{"role": "user", "content": text}]
            chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(chat, add_special_tokens=False).input_ids
        prompts.append(ids)
    compression = CompressionConfig(score_interval=1, compression_interval=10**6)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_cache_bytes=2**32, max_num_seqs=8), compression)
    rng = random.Random(0)
    args.out.mkdir(parents=True, exist_ok=True)
    for i, rec in enumerate(record(engine, prompts, args.max_tokens)):
        windows, targets = samples(rec, config, args.stride, args.entries_per_step, rng)
        tensors = {"windows": windows.contiguous(), "targets": targets.contiguous()}
        save_file(tensors, str(args.out / f"trace-{i:03d}.safetensors"))


if __name__ == "__main__":
    main()
