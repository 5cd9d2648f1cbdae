"""Train the value predictor on traces: windows of entry features and the attention that followed.

A trace file (`.safetensors`) holds `windows` [samples, observation_steps, features] and `targets`
[samples] (log1p of the future attention mass). Training shows progress, keeps a validation split,
stops early when validation stops improving, and saves the best weights with their metadata.

    python -m confkv.compress.predictor.train --traces traces/ --profile small \
        --out confkv/compress/predictor/weights/SmolLM2-135M-Instruct.safetensors
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from confkv.compress.predictor.model import PredictorConfig, ValuePredictor, model_fingerprint, save_predictor

log = logging.getLogger(__name__)


@dataclass
class History:
    train_loss: list[float]
    validation_loss: list[float]
    best_epoch: int


HELD_OUT_EVERY = 4  # every 4th trace file (by name) is kept out of training, for the evidence


def trace_files(folder: Path, held_out: bool) -> list[Path]:
    """The training files, or the held-out ones: whole sequences, so nothing leaks between them."""
    files = sorted(folder.glob("*.safetensors"))
    if len(files) < HELD_OUT_EVERY:
        raise FileNotFoundError(
            f"{len(files)} trace files (*.safetensors) in {folder}; collect at least {HELD_OUT_EVERY} first"
        )
    return [f for i, f in enumerate(files) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held_out]


def load_traces(folder: Path, held_out: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of the training (or held-out) trace files, concatenated."""
    return concat_traces([load_file(str(f)) for f in trace_files(folder, held_out)])


def concat_traces(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Samples of several sequences as one set; each sequence's groups stay distinct."""
    offsets = torch.tensor([0] + [int(p["groups"].max()) + 1 if len(p["groups"]) else 0 for p in parts]).cumsum(0)
    for part, offset in zip(parts, offsets, strict=False):
        part["groups"] = part["groups"] + offset
    return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}


def weighted_error(predicted: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (weights * (predicted - targets) ** 2).sum() / weights.sum()


def sample_weights(traces: dict[str, torch.Tensor], config: PredictorConfig) -> torch.Tensor:
    """End-of-prefill samples are few (one observation per sequence) but decide the most: weigh them up."""
    weights = torch.ones_like(traces["targets"])
    weights[traces["at_prefill"]] = config.prefill_weight
    return weights


def load_error_samples(folder: Path) -> dict[str, torch.Tensor]:
    """The mistakes a server logged (`--predictor-error-samples`): windows and targets, as in traces."""
    parts = [load_file(str(f)) for f in sorted(folder.glob("*.safetensors"))]
    if not parts:
        raise FileNotFoundError(f"no error samples (*.safetensors) in {folder}")
    return {name: torch.cat([p[name] for p in parts]) for name in ("windows", "targets")}


def train(
    windows: torch.Tensor,
    targets: torch.Tensor,
    config: PredictorConfig,
    seed: int = 0,
    progress: bool = True,
    weights: torch.Tensor | None = None,
) -> tuple[ValuePredictor, History]:
    """Fit a predictor (squared error, each sample by its weight); returns the best validation epoch's."""
    weights = torch.ones_like(targets) if weights is None else weights
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    order = torch.randperm(len(targets), generator=generator)
    split = max(1, int(len(targets) * config.validation_share))
    valid, fit = order[:split], order[split:]
    predictor = ValuePredictor(config)
    optimiser = torch.optim.Adam(predictor.parameters(), lr=config.learning_rate)
    history = History([], [], 0)
    best, best_state, stale = float("inf"), None, 0
    epochs = tqdm(range(config.max_epochs), desc="training predictor", unit="epoch", disable=not progress)
    for epoch in epochs:
        predictor.train()
        shuffled = fit[torch.randperm(len(fit), generator=generator)]
        total = 0.0
        for start in range(0, len(shuffled), config.batch_size):
            batch = shuffled[start : start + config.batch_size]
            optimiser.zero_grad()
            loss = weighted_error(predictor(windows[batch]), targets[batch], weights[batch])
            loss.backward()
            optimiser.step()
            total += loss.item() * len(batch)
        history.train_loss.append(total / len(fit))
        predictor.eval()
        with torch.no_grad():
            validation = float(weighted_error(predictor(windows[valid]), targets[valid], weights[valid]))
        history.validation_loss.append(validation)
        epochs.set_postfix(train=f"{history.train_loss[-1]:.4f}", valid=f"{validation:.4f}")
        if validation < best:
            best, stale, history.best_epoch = validation, 0, epoch
            best_state = {k: v.clone() for k, v in predictor.state_dict().items()}
        else:
            stale += 1
            if stale >= config.patience:
                break
    predictor.load_state_dict(best_state)
    return predictor.eval(), history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-path", type=Path, default=None, help="the traces' model (default: embedded)")
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--profile", default=None, help="a named profile of the config (e.g. small)")
    parser.add_argument(
        "--error-samples", type=Path, default=None, help="also train on the server's logged mistakes (a folder)"
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO)
    from transformers import AutoConfig

    from confkv.models.default_model import default_model_path

    fingerprint = model_fingerprint(AutoConfig.from_pretrained(args.model_path or default_model_path()))
    config = PredictorConfig.load(args.config, args.profile)
    traces = load_traces(args.traces)
    windows, targets, weights = traces["windows"], traces["targets"], sample_weights(traces, config)
    log.info("%d training samples (held out: every %dth trace file)", len(targets), HELD_OUT_EVERY)
    if args.error_samples is not None:
        errors = load_error_samples(args.error_samples)
        windows, targets = torch.cat((windows, errors["windows"])), torch.cat((targets, errors["targets"]))
        weights = torch.cat((weights, torch.ones_like(errors["targets"])))
        log.info("%d error samples from %s", len(errors["targets"]), args.error_samples)
    predictor, history = train(windows, targets, config, weights=weights)
    save_predictor(predictor, args.out, fingerprint, {"best_validation_loss": min(history.validation_loss)})
    best = min(history.validation_loss)
    log.info("saved %s (best epoch %d, validation loss %.4f)", args.out, history.best_epoch, best)


if __name__ == "__main__":
    main()
