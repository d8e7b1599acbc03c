"""A tiny target whose distribution is learned: a chat corpus made of rules, and its trainer.

A draft model can only be accepted where the target is predictable, and random weights are not.
This corpus is ChatML conversations made in code (no downloads): the user asks from templates
(count, spell out, recite a times table, repeat or reverse words, name the days or months, write
a note, a capital), and the assistant's answer (30 to 100 tokens, most of them) follows from the
question and the answer so far. `train` fits a small LlamaForCausalLM to it in about two minutes
on two CPU cores, the same weights from the same seed; `write_prompts` writes user turns from the
same generator with other seeds, for a job to generate (the target's own answers) and for
benchmarks on held-out prompts. In that time the model learns the answers' forms, the successor
rules and the lookups (capitals, sums, tables), not yet copying from the prompt: on a question it
never saw, its greedy answer keeps the form and ends its turn, but a slot (a word to repeat, where
a count stops) is often wrong. Its teacher-forced accuracy: `evaluate`, kept beside the weights.

    python -m tools.tiny_models OUT_DIR --only llama-trained    # trains and saves the target
"""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

# The seeds of the target's own corpus and of the two prompt files (`write_prompts`): three
# draws of one generator; the held-out file keeps only questions the other two lack.
CORPUS_SEED = 1234
TRAIN_PROMPTS_SEED = 1235
HELD_OUT_PROMPTS_SEED = 1236

Message = dict[str, str]
Task = Callable[[random.Random], tuple[str, str]]

# -- the corpus ----------------------------------------------------------------------------------

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
_MONTHS = (
    "January February March April May June July August September October November December"
).split()
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
# One token each, after a space, in the tiny tokenizer (tools/tiny_models.py's _WORDS).
_NOUNS = (
    "model layer token state draft target batch request server cluster node shard queue lease "
    "store chunk array sample prompt answer question capital city river mountain ocean history "
    "science music number time world people water light energy computer language data memory"
).split()
_NAMES = "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Oscar Peggy Trent".split()
_CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Japan": "Tokyo", "China": "Beijing", "Egypt": "Cairo", "Kenya": "Nairobi",
    "Peru": "Lima", "Chile": "Santiago", "Canada": "Ottawa", "Norway": "Oslo",
    "Sweden": "Stockholm", "Greece": "Athens", "Russia": "Moscow", "India": "New Delhi",
}  # fmt: skip


def spell(n: int) -> str:
    """0 <= n < 100 in words: 'seven', 'forty', 'twenty-three'."""
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")


def _join(items: Sequence[object]) -> str:
    return ", ".join(str(i) for i in items)


def _count_up(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(8, 25)
    a = rng.randint(0, 100 - n)
    b = a + n - 1
    q = rng.choice(
        [
            f"Count from {a} to {b}.",
            f"Please count up from {a} to {b}.",
            f"List the numbers {a} through {b}.",
        ]
    )
    return q, f"Counting from {a} to {b}: {_join(range(a, b + 1))}. Done."


def _count_by(rng: random.Random) -> tuple[str, str]:
    k = rng.randint(2, 5)
    n = rng.randint(8, 18)
    a = rng.randint(0, 99 - k * (n - 1))
    b = a + k * (n - 1)
    q = rng.choice([f"Count by {k} from {a} to {b}.", f"Count from {a} to {b} in steps of {k}."])
    return q, f"Counting by {k} from {a}: {_join(range(a, b + 1, k))}. Done."


def _count_down(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(8, 25)
    a = rng.randint(0, 100 - n)
    b = a + n - 1
    q = rng.choice([f"Count down from {b} to {a}.", f"Please count backwards from {b} to {a}."])
    return q, f"Counting down from {b}: {_join(range(b, a - 1, -1))}. Liftoff!"


def _spell_range(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(4, 8)
    a = rng.randint(0, 100 - n)
    b = a + n - 1
    q = rng.choice([f"Spell out the numbers from {a} to {b}.", f"Write {a} to {b} in words."])
    return q, f"In words, {a} to {b} is: {_join(spell(i) for i in range(a, b + 1))}. Done."


def _times_table(rng: random.Random) -> tuple[str, str]:
    k, m = rng.randint(2, 9), rng.randint(5, 10)
    q = rng.choice(
        [f"Recite the {k} times table up to {m}.", f"What is the {k} times table to {m}?"]
    )
    rows = " ".join(f"{i} times {k} is {i * k}." for i in range(1, m + 1))
    return q, f"The {k} times table: {rows} That is the table."


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    q = rng.choice([f"What is {a} plus {b}?", f"Add {a} and {b}."])
    words = f"{spell(a)} plus {spell(b)} is {spell(a + b)}"
    return q, f"{a} plus {b} is {a + b}. In words, {words}. So the sum of {a} and {b} is {a + b}."


def _words(rng: random.Random, lo: int, hi: int) -> list[str]:
    return rng.sample(_NOUNS, rng.randint(lo, hi))


def _repeat(rng: random.Random) -> tuple[str, str]:
    words = " ".join(_words(rng, 4, 10))
    q = rng.choice([f"Repeat these words twice: {words}.", f"Say this two times: {words}."])
    return q, f"Sure. The words are: {words}. Once more: {words}. Done."


def _reverse(rng: random.Random) -> tuple[str, str]:
    words = _words(rng, 3, 7)
    q = rng.choice(
        [f"Reverse these words: {' '.join(words)}.", f"Say backwards: {' '.join(words)}."]
    )
    return (
        q,
        f"The words are: {' '.join(words)}. Backwards they are: {' '.join(words[::-1])}. Done.",
    )


def _days(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        start, n = rng.randrange(7), rng.randint(3, 7)
        days = [_DAYS[(start + i) % 7] for i in range(1, n + 1)]
        q = rng.choice(
            [f"Name the {n} days after {_DAYS[start]}.", f"Which {n} days follow {_DAYS[start]}?"]
        )
        return q, f"The {n} days after {_DAYS[start]} are: {_join(days)}. That is the list."
    start, n = rng.randrange(12), rng.randint(4, 12)
    months = [_MONTHS[(start + i) % 12] for i in range(n)]
    first, last = months[0], months[-1]
    q = rng.choice(
        [f"List the months from {first} to {last}.", f"Name the months {first} through {last}."]
    )
    return q, f"From {months[0]} to {months[-1]}: {_join(months)}. That is the list."


def _letters(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(6, 16)
    a = rng.randint(0, 26 - n)
    letters = _LETTERS[a : a + n]
    first, last = letters[0], letters[-1]
    q = rng.choice(
        [f"List the letters from {first} to {last}.", f"Say the alphabet from {first} to {last}."]
    )
    return q, f"The letters from {letters[0]} to {letters[-1]} are: {_join(letters)}. Done."


def _note(rng: random.Random) -> tuple[str, str]:
    name, topic = rng.choice(_NAMES), rng.choice(_NOUNS)
    q = rng.choice(
        [f"Write a short note to {name} about the {topic}.", f"Send {name} a note on the {topic}."]
    )
    return q, (
        f"Dear {name}, this is a short note about the {topic}. I hope the {topic} is going well "
        f"for you, {name}. Best wishes, the assistant."
    )


def _capital(rng: random.Random) -> tuple[str, str]:
    country = rng.choice(sorted(_CAPITALS))
    city = _CAPITALS[country]
    q = rng.choice([f"What is the capital of {country}?", f"Name the capital city of {country}."])
    return q, f"The capital of {country} is {city}. {city} is the capital city of {country}."


TASKS: dict[str, Task] = {
    "count_up": _count_up,
    "count_by": _count_by,
    "count_down": _count_down,
    "spell_range": _spell_range,
    "times_table": _times_table,
    "add": _add,
    "repeat": _repeat,
    "reverse": _reverse,
    "days": _days,
    "letters": _letters,
    "note": _note,
    "capital": _capital,
}


def _stream(seed: int) -> Iterator[tuple[str, list[Message]]]:
    rng = random.Random(seed)
    names = list(TASKS)
    while True:
        task = rng.choice(names)
        question, answer = TASKS[task](rng)
        yield (
            task,
            [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        )


def conversations(seed: int, n: int) -> list[tuple[str, list[Message]]]:
    """n (task, [user turn, assistant turn]) pairs, the same for the same seed."""
    return list(itertools.islice(_stream(seed), n))


def held_out_conversations(
    n: int, seed: int = HELD_OUT_PROMPTS_SEED, exclude: Iterable[str] = ()
) -> list[tuple[str, list[Message]]]:
    """The first n conversations of the seed's draw whose question is neither in the target's
    corpus nor in `exclude`, nor asked before in the draw. Tasks of few distinct questions (a
    capital, a sum, a times table) are all in the corpus, so they are rare or absent here."""
    seen = {c[0]["content"] for _, c in conversations(CORPUS_SEED, corpus_size())} | set(exclude)
    out = []
    for task, conv in _stream(seed):
        if len(out) == n:
            return out
        if conv[0]["content"] not in seen:
            seen.add(conv[0]["content"])
            out.append((task, conv))
    raise AssertionError("unreachable: the stream is endless")


@dataclass(frozen=True)
class PromptFiles:
    train: Path  # for the job that captures (or generates) the drafter's training data
    held_out: Path  # for benchmarks: no question of it is in `train` or in the target's corpus


def write_prompts(
    out_dir: Path,
    *,
    train: int = 512,
    held_out: int = 128,
    train_seed: int = TRAIN_PROMPTS_SEED,
    held_out_seed: int = HELD_OUT_PROMPTS_SEED,
) -> PromptFiles:
    """OUT_DIR/train_prompts.jsonl, `conversations(train_seed, train)`, and
    OUT_DIR/held_out_prompts.jsonl, `held_out_conversations(held_out, held_out_seed, exclude=
    train's questions)`: chat rows of the user turn alone, for a `generate:` job to answer,
    `{"id": "train-00000", "task": "count_up", "messages": [{"role": "user", "content": ...}]}`
    (ids `held-out-00000`, ... in the other). The answers: the same calls' assistant turns."""
    out_dir.mkdir(parents=True, exist_ok=True)
    train_rows = conversations(train_seed, train)
    held_rows = held_out_conversations(
        held_out, held_out_seed, (c[0]["content"] for _, c in train_rows)
    )
    files = PromptFiles(out_dir / "train_prompts.jsonl", out_dir / "held_out_prompts.jsonl")
    for path, prefix, rows in (
        (files.train, "train", train_rows),
        (files.held_out, "held-out", held_rows),
    ):
        with path.open("w") as f:
            for k, (task, conv) in enumerate(rows):
                row = {"id": f"{prefix}-{k:05d}", "task": task, "messages": conv[:1]}
                f.write(json.dumps(row) + "\n")
    return files


# -- training ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1200
    batch: int = 12  # conversations a step: a small one, as a CPU step is mostly overhead
    lr: float = 3e-3
    warmup: int = 60
    weight_decay: float = 0.01
    threads: int = 2  # fixed: the sums' order, and so the weights, do not depend on the cores
    seed: int = CORPUS_SEED


def corpus_size(config: TrainConfig = TrainConfig()) -> int:
    return config.steps * config.batch


def encode(
    tokenizer: PreTrainedTokenizerFast, conversation: list[Message]
) -> tuple[list[int], list[int]]:
    """Token ids as the chat template renders the conversation, and its assistant mask (the
    answer and its <|im_end|>), as the planner makes them."""
    out = tokenizer.apply_chat_template(
        conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def _batches(
    tokenizer: PreTrainedTokenizerFast, convs: list[list[Message]], batch: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels) batches of conversations of like length, in a seeded order, padded on
    the right: causal attention never looks right, so no attention mask is needed."""
    encoded = [encode(tokenizer, c) for c in convs]
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i][0]), i))
    groups = [order[i : i + batch] for i in range(0, len(order), batch)]
    random.Random(seed).shuffle(groups)
    out = []
    for group in groups:
        width = max(len(encoded[i][0]) for i in group)
        ids = torch.full((len(group), width), tokenizer.pad_token_id)
        labels = torch.full((len(group), width), -100)
        for row, i in enumerate(group):
            tokens, mask = map(torch.tensor, encoded[i])
            ids[row, : len(tokens)] = tokens
            labels[row, : len(tokens)] = torch.where(mask == 1, tokens, -100)
        out.append((ids, labels))
    return out


def _loss(model: PreTrainedModel, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the answers' tokens only: the LM head and its softmax skip
    the questions and the padding (a third of the tokens)."""
    hidden = model.base_model(input_ids=ids).last_hidden_state[:, :-1]
    target = labels[:, 1:]
    where = target != -100
    logits = model.get_output_embeddings()(hidden[where])
    return torch.nn.functional.cross_entropy(logits, target[where])


@dataclass(frozen=True)
class TrainStats:
    steps: int
    tokens: int  # answer tokens trained on
    final_loss: float  # mean of the last 50 steps' losses
    seconds: float  # wall time, corpus and tokenization included


def train(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    config: TrainConfig = TrainConfig(),
) -> TrainStats:
    """Fit the model (float32, as initialised under the caller's seed) to the corpus, in place:
    AdamW, linear warmup then cosine decay, on `config.threads` threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    torch.set_flush_denormal(True)  # tiny values late in training: else some steps slow many-fold
    try:
        start = time.monotonic()
        torch.manual_seed(config.seed)
        convs = [c for _, c in conversations(config.seed, corpus_size(config))]
        batches = _batches(tokenizer, convs, config.batch, config.seed)
        params = dict(model.named_parameters())
        opt = torch.optim.AdamW(
            [
                {"params": [p for p in params.values() if p.dim() >= 2]},
                {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=config.lr,
            betas=(0.9, 0.98),
            weight_decay=config.weight_decay,
        )

        def lr_factor(step: int) -> float:
            if step < config.warmup:
                return (step + 1) / config.warmup
            progress = (step - config.warmup) / max(1, len(batches) - config.warmup)
            return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
        model.train()
        losses, tokens = [], 0
        for ids, labels in batches:
            loss = _loss(model, ids, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            schedule.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            tokens += int((labels != -100).sum())
        model.eval()
        tail = losses[-50:]
        return TrainStats(len(batches), tokens, sum(tail) / len(tail), time.monotonic() - start)
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)


# -- evaluation ----------------------------------------------------------------------------------

REPORT_FILE = "trained_target.json"  # in the model's directory: its training and its accuracy


@torch.no_grad()
def teacher_forced_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    convs: list[tuple[str, list[Message]]],
) -> dict[str, float]:
    """Per task and overall ("all"): of the answers' tokens (and their <|im_end|>), the share
    where the model's argmax after the reference prefix is the reference token."""
    hits: dict[str, list[bool]] = {}
    for task, conv in convs:
        ids, mask = encode(tokenizer, conv)
        pred = model(input_ids=torch.tensor([ids])).logits[0, :-1].argmax(-1)
        where = torch.tensor(mask[1:]) == 1
        ok = (pred[where] == torch.tensor(ids[1:])[where]).tolist()
        for key in (task, "all"):
            hits.setdefault(key, []).extend(ok)
    return {k: round(sum(v) / len(v), 4) for k, v in sorted(hits.items())}


@torch.no_grad()
def greedy_answer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    question: str,
    max_new_tokens: int = 160,
) -> str:
    """The model's greedy answer to one user turn, up to and with its <|im_end|>."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(out[0, ids.shape[1] :])


def greedy_exact(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    convs: list[tuple[str, list[Message]]],
) -> dict[str, float]:
    """Per task and overall: the share of greedy answers that are the reference's, exactly."""
    hits: dict[str, list[bool]] = {}
    for task, conv in convs:
        got = greedy_answer(model, tokenizer, conv[0]["content"])
        for key in (task, "all"):
            hits.setdefault(key, []).append(got == conv[1]["content"] + "<|im_end|>")
    return {k: round(sum(v) / len(v), 4) for k, v in sorted(hits.items())}


def evaluate(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, n: int = 200
) -> dict[str, dict[str, float]]:
    """Teacher-forced accuracy on the held-out seed's first n conversations ("draw": the few
    questions a task has, a capital or a sum, are also in the corpus) and on n whose questions
    the corpus lacks ("unseen": mostly counting and copying, the tasks of many questions)."""
    return {
        "draw": teacher_forced_accuracy(model, tokenizer, conversations(HELD_OUT_PROMPTS_SEED, n)),
        "unseen": teacher_forced_accuracy(model, tokenizer, held_out_conversations(n)),
    }


def report(stats: TrainStats, accuracy: dict[str, dict[str, float]]) -> dict[str, Any]:
    """What the model's directory keeps of its training: no wall time, so that the same seed
    gives the same bytes."""
    train_fields = {k: v for k, v in asdict(stats).items() if k != "seconds"}
    return {"train": train_fields, "teacher_forced_accuracy": accuracy}
