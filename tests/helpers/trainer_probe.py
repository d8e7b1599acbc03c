"""Runs inside .venv-trainers (never imported by the product or by pytest): loads an export
through a released trainer's own data code, builds its teacher with its own head code, and runs
one training step with its own model code on CPU. Writes what it loaded to OUT.safetensors and
what it measured to OUT.json, for tests/integration/test_trainers.py to check against the store.

    python tests/helpers/trainer_probe.py specforge EXPORT_DIR RUN_CONFIG_JSON OUT
    python tests/helpers/trainer_probe.py speculators EXPORT_DIR[,CONTROL...] VERIFIER_DIR OUT \
        LAYER_ID...

Per sample `i` (the store's global sample index, from the file name): `i.input_ids`,
`i.loss_mask`, `i.draft_input` (what the draft model is fed), `i.target` (the state its
teacher is built from), `i.teacher_top1` (argmax of the teacher's logits).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

# The trainers' own code paths that need no GPU. SpecForge: attention_backend "sdpa" (its
# flex_attention default compiles a kernel), and its KL loss `LogSoftmaxLoss` (a Triton
# kernel) swapped for `_compute_loss`, marked "Reference implementation" in the same
# specforge/core/loss.py; speculators: draft_attn_impl "sdpa" and
# loss_implementation "eager" (its PyTorch version of the fused loss).
SPECFORGE_CPU_OVERRIDES = ["training.attention_backend=sdpa"]


class SpecForgeReferenceLoss:
    """`LogSoftmaxLoss.apply` by SpecForge's own PyTorch reference of that kernel."""

    @staticmethod
    def apply(logits, target_p, position_mask):
        from specforge.core.loss import _compute_loss

        return _compute_loss(logits, target_p, position_mask)


def file_index(path: str) -> int:
    return int(re.search(r"(\d+)\.(ckpt|safetensors)$", path).group(1))


def train_one_step(model: torch.nn.Module, loss_of) -> dict[str, float]:
    """One AdamW step; the loss again on the same batch, and how far the weights moved."""
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    loss = loss_of()
    loss.backward()
    optimizer.step()
    moved = sum(float((p.detach() - b).abs().sum()) for p, b in zip(params, before, strict=True))
    with torch.no_grad():
        after = loss_of()
    return {"loss": float(loss), "loss_after": float(after), "weights_moved": moved}


def probe_specforge(export_dir: str, run_config: str, out: str) -> tuple[dict, dict]:
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.application import resolve_run
    from specforge.config.schema import load_config
    from specforge.data.preprocessing import build_offline_eagle3_dataset
    from specforge.data.utils import DataCollatorWithPadding
    from specforge.runtime.contracts import TrainBatch
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader
    from specforge.training.assembly import build_model_bundle
    from specforge.training.model_loading import draft_config_dict
    from specforge.training.strategies.base import Eagle3TrainStrategy

    overrides = [*SPECFORGE_CPU_OVERRIDES, f"data.cache_dir={out}.cache"]
    cfg = load_config(run_config, overrides)  # the exported run.yaml, validated
    # Its draft config derived from the target, as `specforge train` derives it, but for the
    # draft vocabulary: its default of 32000 exceeds the tiny model's 1024 tokens; the full
    # vocabulary, as a pruned one would mask out every position whose teacher token it lacks.
    draft = draft_config_dict(cfg, provider=resolve_run(cfg).algorithm.providers.model.draft_config)
    draft["draft_vocab_size"] = draft["vocab_size"]
    Path(f"{out}.draft.json").write_text(json.dumps(draft))
    cfg = load_config(run_config, [*overrides, f"model.draft_model_config={out}.draft.json"])
    resolved = resolve_run(cfg)
    max_len = cfg.data.max_length
    refs = OfflineManifestReader(export_dir, max_len=max_len).read()
    paths = [ref.feature_store_uri.removeprefix("file://") for ref in refs]
    legacy = build_offline_eagle3_dataset(export_dir, max_len=max_len)
    assert sorted(legacy.datapaths) == sorted(paths), "the two readers list other files"
    legacy_of = {file_index(p): k for k, p in enumerate(legacy.datapaths)}
    bundle = build_model_bundle(resolved.config, algorithm=resolved.algorithm)
    head = bundle.target_head
    tensors, items = {}, []
    for path in paths:
        i = file_index(path)
        item = normalize_offline_sample(load_feature_file(path), max_len)  # the runtime path
        old = legacy[legacy_of[i]]  # the retained Dataset path: must agree
        for key in ("input_ids", "loss_mask", "hidden_state", "target"):
            assert torch.equal(old[key], item[key]), f"sample {i}: {key} differs between readers"
        with torch.no_grad():
            logits = head(item["target"])  # TargetHead: the bf16 lm_head, as training runs it
        tensors |= {
            f"{i}.input_ids": item["input_ids"][0],
            f"{i}.loss_mask": item["loss_mask"][0],
            f"{i}.draft_input": item["hidden_state"][0],
            f"{i}.target": item["target"][0],
            f"{i}.teacher_top1": logits[0].argmax(-1),
        }
        items.append(item)
    eagle3_model.LogSoftmaxLoss = SpecForgeReferenceLoss
    strategy = Eagle3TrainStrategy(bundle.model, target_head=head)
    batch = TrainBatch(
        sample_ids=[str(file_index(p)) for p in paths[:2]],
        strategy="eagle3",
        tensors=DataCollatorWithPadding()(items[:2]),
        metadata={"target_repr": "hidden_state"},
    )
    step = train_one_step(bundle.model, lambda: strategy.forward_loss(batch).loss)
    return tensors, {"files": len(paths), **step}


def probe_speculators(
    export_dirs: str, verifier: str, out: str, layer_ids: list[int]
) -> tuple[dict, dict]:
    """`export_dirs`: the export, then (comma-separated) controls loaded with the same model,
    their tensors under `k/` (k counting from 0); the training step runs on the export."""
    export_dir, *controls = export_dirs.split(",")
    from speculators.data_generation.offline import check_hidden_states
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.data import ArrowDataset
    from speculators.train.dataloader import create_train_val_loaders
    from speculators.train.recovery import SampleUnavailable
    from speculators.train.vocab_mapping import (
        build_vocab_mappings_from_distribution,
        get_target_vocab_size,
        save_token_frequency_distribution,
    )

    dataset = ArrowDataset(max_len=8192, datapath=export_dir, on_missing="skip")
    # token_freq.pt as --draft-vocab-size reads it, and as speculators itself counts it.
    token_freq = torch.load(Path(export_dir) / "token_freq.pt", weights_only=True)
    recount = Path(f"{out}.token_freq.pt")
    recount.unlink(missing_ok=True)  # it would reuse one, not count
    save_token_frequency_distribution(dataset.data, recount)
    vocab = get_target_vocab_size(None, verifier)
    d2t, _ = build_vocab_mappings_from_distribution(token_freq, 64, vocab)
    # The full vocabulary, so that the model's own verifier_lm_head is the whole lm_head.
    config = create_transformer_layer_config(verifier, 1, "llama", None, 2048, [0])
    model = Eagle3DraftModel.from_training_args(
        verifier_config=config,
        target_layer_ids=layer_ids,
        verifier_name_or_path=verifier,
        draft_attn_impl="sdpa",
        draft_vocab_size=vocab,
        norm_before_residual=True,
        ttt_steps=2,
    )
    facts = {
        "token_freq_as_speculators_counts": token_freq == torch.load(recount, weights_only=True),
        "d2t_size": len(d2t),
    }
    tensors, present = {}, 0
    for prefix, data_dir in (("", export_dir), *((f"{k}/", d) for k, d in enumerate(controls))):
        read = ArrowDataset(max_len=8192, datapath=data_dir, on_missing="skip")
        for i in range(len(read)):
            sample = read[i]
            if isinstance(sample, SampleUnavailable):
                continue
            present += not prefix
            raw = read.transfer.get_cached(i)
            check_hidden_states(raw, read.data[i]["input_ids"].tolist())  # raises if not
            last = sample["verifier_last_hidden_states"]
            # Eagle3DraftModel.forward's teacher, under the trainer's autocast.
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model.verifier_lm_head(model.verifier_norm(last.to(torch.bfloat16)))
            tensors |= {
                f"{prefix}{i}.input_ids": sample["input_ids"],
                f"{prefix}{i}.loss_mask": sample["loss_mask"],
                f"{prefix}{i}.draft_input": sample["hidden_states"],
                f"{prefix}{i}.target": last,
                f"{prefix}{i}.teacher_top1": logits.argmax(-1),
            }
    train, _ = create_train_val_loaders(
        data_path=export_dir,
        total_seq_len=512,
        hidden_states_dtype=torch.bfloat16,
        vllm_endpoint="http://127.0.0.1:9/v1",  # never asked: --on-missing skip
        on_missing="skip",
        verifier_name_or_path=verifier,
        request_timeout=1,
        max_retries=0,
        generation_validation_retries=0,
        max_consecutive_generation_failures=1,
        hidden_size=config.hidden_size,
        num_target_layers=len(layer_ids),
        num_workers=0,
        prefetch_factor=1,
        preprocess=shift_batch,
        train_data_ratio=0.75,
    )
    batch = next(iter(train))
    kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", ttt_steps=2, ttt_step_loss_decay=1.0
    )
    inputs = {
        k: batch[k]
        for k in (
            "hidden_states",
            "input_ids",
            "document_ids",
            "loss_mask",
            "position_ids",
            "verifier_last_hidden_states",
        )
    }
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step = train_one_step(model, lambda: model(**inputs, **kwargs)[1])
    return tensors, {**facts, "files": present, **step}


def main() -> None:
    fmt, export_dir = sys.argv[1], sys.argv[2]
    if fmt == "specforge":
        out = sys.argv[4]
        tensors, facts = probe_specforge(export_dir, sys.argv[3], out)
    else:
        out = sys.argv[4]
        tensors, facts = probe_speculators(export_dir, sys.argv[3], out, [*map(int, sys.argv[5:])])
    save_file({k: v.contiguous() for k, v in tensors.items()}, f"{out}.safetensors")
    Path(f"{out}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main()
