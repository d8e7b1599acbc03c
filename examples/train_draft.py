"""Train an EAGLE-3 draft on CPU from an `hsx export --format speculators` directory, with
speculators' own data pipeline, draft model and loss, for a bounded number of steps.

    .venv-trainers/bin/python examples/train_draft.py --data-path out/export \\
        --max-steps 300 --total-seq-len 1024 --save-path out/draft-speculators

The verifier and its layers default to the store's (the export's `export.json` names its
manifest's `model` and `layer_ids`). The flags are those of `speculators train` (0.9.0), whose
trainer needs an accelerator (it moves every batch to `cuda:<local rank>`); this loop is its
step on CPU: speculators' `create_train_val_loaders` over the export (packed `--total-seq-len`
tokens a batch, shifted by its `shift_batch`), `Eagle3DraftModel.from_training_args`, the KL
loss against the verifier's own head under bf16 autocast, AdamW, gradients clipped at 1.0; at
the end, the loss and per-step accuracies on the export's held-out split. `--max-steps 0` saves
the draft as initialized: the random baseline a trained draft must beat.

The draft is trained with `norm_before_residual` off: speculators' default (on) is a forward
SGLang's EAGLE-3 draft layer does not run, and `hsx draft-convert` refuses such a draft.
Writes SAVE_PATH (speculators' format, `save_pretrained`) and SAVE_PATH/train_log.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

MODEL_INPUTS = (
    "hidden_states",
    "input_ids",
    "document_ids",
    "loss_mask",
    "position_ids",
    "verifier_last_hidden_states",
)


def main() -> None:
    args = parse_args()
    manifest = json.loads((Path(args.data_path) / "export.json").read_text())["manifest"]
    args.verifier_name_or_path = args.verifier_name_or_path or manifest["model"]
    args.target_layer_ids = args.target_layer_ids or manifest["layer_ids"]
    torch.manual_seed(args.seed)
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.dataloader import create_train_val_loaders
    from transformers import AutoConfig

    verifier = args.verifier_name_or_path
    vocab_size = AutoConfig.from_pretrained(verifier).vocab_size
    config = create_transformer_layer_config(verifier, 1, "llama", None, 2048, [0])
    model = Eagle3DraftModel.from_training_args(
        verifier_config=config,
        target_layer_ids=args.target_layer_ids,
        verifier_name_or_path=verifier,
        draft_attn_impl="sdpa",  # its default, flex attention, compiles a kernel
        draft_vocab_size=vocab_size,  # the full vocabulary: a small verifier's is small
        norm_before_residual=False,
        ttt_steps=args.ttt_steps,
    )
    log: list[dict[str, float]] = []
    if args.max_steps > 0:
        train, val = create_train_val_loaders(
            data_path=args.data_path,
            total_seq_len=args.total_seq_len,
            hidden_states_dtype=torch.bfloat16,
            vllm_endpoint="http://127.0.0.1:9/v1",  # never asked: --on-missing skip
            on_missing="skip",
            verifier_name_or_path=verifier,
            request_timeout=1,
            max_retries=0,
            generation_validation_retries=0,
            max_consecutive_generation_failures=1,
            hidden_size=config.hidden_size,
            num_target_layers=len(args.target_layer_ids),
            num_workers=0,
            prefetch_factor=1,
            preprocess=shift_batch,
            train_data_ratio=args.train_data_ratio,
            seed=args.seed,
        )
        log = train_steps(model, train, args)
        metrics = validate(model, val, args)
        log[-1].update(metrics)
        print("validation: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()), flush=True)
    args.save_path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.save_path)
    (args.save_path / "train_log.json").write_text(json.dumps(log, indent=1))
    print(f"saved the draft after {len(log)} steps to {args.save_path}", flush=True)


def loss_kwargs(args: argparse.Namespace) -> dict:
    from speculators.models.eagle3.core import Eagle3DraftModel

    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", ttt_steps=args.ttt_steps,
        ttt_step_loss_decay=1.0,
    )  # fmt: skip
    return train_kwargs


def train_steps(model: torch.nn.Module, loader, args: argparse.Namespace) -> list[dict]:
    kwargs = loss_kwargs(args)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps)
    )
    model.train()
    log: list[dict] = []
    start = time.monotonic()
    while len(log) < args.max_steps:  # epochs over the export until max_steps
        for batch in loader:
            inputs = {k: batch[k] for k in MODEL_INPUTS}
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss, _ = model(**inputs, **kwargs)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            log.append({"step": len(log) + 1, "loss": loss.item(), "s": time.monotonic() - start})
            if len(log) % args.log_every == 0 or len(log) == args.max_steps:
                print(f"step {len(log)}: loss {loss.item():.4f}", flush=True)
            if len(log) == args.max_steps:
                break
    return log


@torch.no_grad()
def validate(model: torch.nn.Module, loader, args: argparse.Namespace) -> dict[str, float]:
    """Over the held-out split (the export's last `1 - --train-data-ratio`): the mean loss and,
    per draft step k, `val_full_acc_k`: the share of positions whose drafts 0..k all match the
    verifier's argmax (speculators' metric; what acceptance measures when served)."""
    kwargs = loss_kwargs(args)
    model.eval()
    losses, counts = [], {}
    for batch in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss, metrics = model(**{k: batch[k] for k in MODEL_INPUTS}, **kwargs)
        losses.append(loss.item())
        for name, value in metrics.items():  # `<metric>_sum` / `<metric>_total` pairs
            counts[name] = counts.get(name, 0.0) + float(value)
    model.train()
    accuracies = {
        f"val_{name}": counts[f"{name}_sum"] / max(counts[f"{name}_total"], 1)
        for name in (key.removesuffix("_sum") for key in counts if key.endswith("_sum"))
        if name.startswith("full_acc_")
    }
    return {"val_loss": sum(losses) / len(losses), **accuracies}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-path", required=True, help="the speculators export")
    parser.add_argument("--verifier-name-or-path", help="the target (default: the store's)")
    parser.add_argument(
        "--target-layer-ids", type=int, nargs="+", help="default: the store's layer_ids"
    )
    parser.add_argument("--save-path", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--total-seq-len", type=int, default=2048, help="tokens a batch")
    parser.add_argument("--train-data-ratio", type=float, default=0.95, help="the rest: validation")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--ttt-steps", type=int, default=3, help="speculators' ttt_steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20)
    return parser.parse_args()


if __name__ == "__main__":
    main()
