"""Train an EAGLE-3 draft head while the extraction job is still writing its store.

    rm -rf out/demo/demo.zarr out/draft   # not the last demo's store: `make demo` remakes it
    make demo &                           # or any job; the store may not exist yet
    .venv-trainers/bin/python examples/train_while_extracting.py \\
        --store out/demo/demo.zarr --out out/draft

The draft model, its loss and its sequence packing are speculators' own (0.9.0, installed in
.venv-trainers by `make setup`, as tests/integration/test_trainers.py runs it); only the data
comes from this project's follow reader (`HiddenStatesIterable(follow=True)`), which yields
each sample of the store once, as its shard commits, and ends when the job is complete.

Every `--save-every` steps it writes OUT/checkpoint.pt: the draft's and the optimizer's
state, the reader's cursor, the ids of the samples trained on, and one line per step. Killed
and started again with the same arguments, it resumes from there: the samples trained after
the checkpoint are read again, every other sample is never trained on twice. At the end it
writes the draft in speculators' format to OUT/draft (what vLLM loads as a speculator).

On CPU this trains the tiny demo model in seconds; on a GPU node, pass `--device cuda`. It
trains in one process: a distributed trainer would wrap the model in DDP and give each rank's
reader its rank and world size (docs/using-the-data.md), with a checkpoint per rank.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import zarr

from hsx_store.format import Store
from hsx_store.reader import HiddenStatesIterable, Sample

# speculators (and transformers under it) take ~10 s to import on a small machine: imported once
# the store and the checkpoint are known to be usable, so a wrong argument fails at once.

CHECKPOINT = "checkpoint.pt"
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
    args.out.mkdir(parents=True, exist_ok=True)
    store = wait_for_store(args.store, args.wait_s)
    manifest = store.manifest
    if "pre_norm" not in manifest.final_states:
        raise SystemExit(
            f"{args.store} keeps no pre-norm final state (store.prenorm: false): speculators' "
            "teacher normalizes the state it is given, so it needs the pre-norm one"
        )
    device = torch.device(args.device)
    store_id = store.group.attrs["store_id"]  # new at every creation of a store
    checkpoint = args.out / CHECKPOINT
    saved = load_checkpoint(checkpoint, store_id, device)
    from speculators.models.eagle3.core import Eagle3DraftModel

    verifier = args.verifier or manifest.model
    model = draft_model(verifier, manifest.layer_ids, args.ttt_steps).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    reader = HiddenStatesIterable(
        args.store,
        shuffle=True,
        seed=args.seed,
        follow=True,
        poll_s=args.poll_s,
        idle_timeout_s=args.idle_timeout_s,
    )
    progress: dict[str, Any] = {"store_id": store_id, "step": 0, "trained": [], "history": []}
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        reader.load_state_dict(saved["reader"])
        progress = saved["progress"]
        print(f"resumed from step {progress['step']} ({len(progress['trained'])} samples)")
    print(f"following {args.store}", flush=True)
    loss_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", ttt_steps=args.ttt_steps,
        ttt_step_loss_decay=1.0,
    )  # fmt: skip
    model.train()
    for batch in batches(reader, args.samples_per_step):
        inputs = packed(batch, manifest.hidden_size, manifest.num_aux, device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss, _ = model(**inputs, **loss_kwargs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        progress["step"] += 1
        progress["trained"] += [s["sample_id"] for s in batch]
        tokens = sum(len(s["input_ids"]) for s in batch)
        line = {"step": progress["step"], "loss": loss.item(), "tokens": tokens}
        progress["history"].append(line | {"time": time.time()})
        print(f"step {line['step']}: loss {line['loss']:.4f} on {len(batch)} samples", flush=True)
        if progress["step"] % args.save_every == 0:
            save(checkpoint, model, optimizer, reader, progress)
    save(checkpoint, model, optimizer, reader, progress)
    model.save_pretrained(args.out / "draft")
    print(f"following ended: {reader.ended}")
    print(f"trained {progress['step']} steps on {len(progress['trained'])} samples")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="the job's store.url (local or s3://)")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint and draft folder")
    parser.add_argument("--verifier", help="the target model's folder (default: the store's)")
    parser.add_argument("--samples-per-step", type=int, default=4)
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--ttt-steps", type=int, default=3, help="speculators' ttt_steps")
    parser.add_argument("--seed", type=int, default=0, help="the reader's shuffle seed")
    parser.add_argument("--poll-s", type=float, default=2.0, help="the reader's poll interval")
    parser.add_argument("--idle-timeout-s", type=float, default=1800.0)
    parser.add_argument("--wait-s", type=float, default=600.0, help="wait for the store this long")
    parser.add_argument("--device", default="cpu")
    return parser.parse_args()


def wait_for_store(url: str, timeout_s: float) -> Store:
    """The store, once the job has created it (a trainer may start with the job)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Store.open(url)
        except (FileNotFoundError, zarr.errors.GroupNotFoundError):
            if time.monotonic() > deadline:
                raise SystemExit(f"{url}: no store there after {timeout_s:g} s") from None
            time.sleep(1.0)


def load_checkpoint(path: Path, store_id: str, device: torch.device) -> dict[str, Any] | None:
    """The saved state, if any; refused if saved from another store (its cursor would skip
    shards of this one)."""
    if not path.exists():
        return None
    # Our own file, still loaded as any torch file should be: weights_only.
    saved = torch.load(path, map_location=device, weights_only=True)
    if saved["progress"]["store_id"] != store_id:
        raise SystemExit(
            f"{path} was trained from another store (store_id {saved['progress']['store_id']}, "
            f"this one's is {store_id}: a store made again since): resume it from that store, "
            "or train into another --out"
        )
    return saved


def draft_model(verifier: str, layer_ids: list[int], ttt_steps: int) -> torch.nn.Module:
    """speculators' default draft: one Llama decoder layer shaped after the verifier, its
    embedding, final norm and lm_head taken from the verifier, the full vocabulary (a pruned
    draft vocabulary is chosen from token counts over the whole data, which a job still
    running does not have yet)."""
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from transformers import AutoConfig

    config = create_transformer_layer_config(verifier, 1, "llama", None, 2048, [0])
    return Eagle3DraftModel.from_training_args(
        verifier_config=config,
        target_layer_ids=layer_ids,
        verifier_name_or_path=verifier,
        draft_attn_impl="sdpa",  # its default, flex attention, compiles a kernel
        draft_vocab_size=AutoConfig.from_pretrained(verifier).vocab_size,
        norm_before_residual=False,  # the forward SGLang serves (hsx draft-convert)
        ttt_steps=ttt_steps,
    )


def batches(reader: HiddenStatesIterable, size: int) -> Iterator[list[Sample]]:
    """`size` samples at a time, the last batch possibly smaller. A step is taken as soon as
    its samples are read: with a running job, a half-filled batch could wait for hours."""
    batch: list[Sample] = []
    for sample in reader:
        batch.append(sample)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def packed(batch: list[Sample], hidden_size: int, num_aux: int, device: torch.device) -> dict:
    """The batch as speculators' trainer feeds its model: each sample in its dataset's layout,
    shifted by its `shift_batch`, packed into one sequence by its `CollateFn`."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    items = []
    for s in batch:
        length = len(s["input_ids"])
        items.append(
            {
                "hidden_states": s["aux_hidden_states"],
                "input_ids": s["input_ids"],
                "verifier_last_hidden_states": s["prenorm_hidden_states"],
                "loss_mask": s["loss_mask"],
                "lengths": torch.tensor([length]),
                "position_ids": torch.arange(length),
            }
        )
    total = sum(len(s["input_ids"]) - 1 for s in batch)  # shift_batch drops one per sample
    collate = CollateFn(total, hidden_size, num_aux, preprocess=shift_batch)
    tensors = collate(items)
    return {k: tensors[k].to(device) for k in MODEL_INPUTS}


def save(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    reader: HiddenStatesIterable,
    progress: dict[str, Any],
) -> None:
    """Written whole or not at all: a kill while saving leaves the previous checkpoint."""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "reader": reader.state_dict(),  # after this step's samples, none read beyond them
        "progress": progress,
    }
    partial = path.with_suffix(".tmp")
    torch.save(state, partial)
    os.replace(partial, path)


if __name__ == "__main__":
    main()
