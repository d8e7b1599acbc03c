"""The trained target's corpus (tools/trained_target.py): the same seed draws the same
conversations, each answer follows its task's rule, answers are long enough to draft, the prompt
files are rows the planner takes and the held-out ones are unseen; and a few training steps of
a model two layers deep give the same weights twice (the preset's training itself is too slow
for this tier: `python -m tools.tiny_models OUT --only llama-trained`)."""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster.config import DataConfig
from cluster.plan_encode import parse_row
from tools import tiny_models
from tools.trained_target import (
    _CAPITALS,
    _DAYS,
    _LETTERS,
    _MONTHS,
    _NOUNS,
    CORPUS_SEED,
    TASKS,
    TrainConfig,
    conversations,
    corpus_size,
    encode,
    held_out_conversations,
    spell,
    train,
    write_prompts,
)


@pytest.fixture(scope="module")
def tokenizer() -> tiny_models.PreTrainedTokenizerFast:
    return tiny_models.make_tokenizer()


def ints(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def listed(answer: str) -> list[str]:
    """The comma-separated list between the answer's first ': ' and the '.' after it."""
    return answer.split(": ", 1)[1].split(".", 1)[0].split(", ")


def follows_rule(task: str, q: str, a: str) -> bool:
    """Each task's rule, checked from the question's slots as a reader would."""
    if task in ("count_up", "count_down"):
        hi, lo = sorted(ints(q), reverse=True)[:2]
        step = 1 if task == "count_up" else -1
        want = range(lo, hi + 1) if step == 1 else range(hi, lo - 1, -1)
        return listed(a) == [str(n) for n in want]
    if task == "count_by":
        n = ints(q)  # "Count by k from a to b." or "Count from a to b in steps of k."
        k, lo, hi = (n[0], n[1], n[2]) if q.startswith("Count by") else (n[2], n[0], n[1])
        return listed(a) == [str(v) for v in range(lo, hi + 1, k)]
    if task == "spell_range":
        lo, hi = ints(q)
        return listed(a) == [spell(v) for v in range(lo, hi + 1)]
    if task == "times_table":
        k, m = ints(q)
        rows = re.findall(r"(\d+) times (\d+) is (\d+)\.", a)
        return rows == [(str(i), str(k), str(i * k)) for i in range(1, m + 1)]
    if task == "add":
        x, y = ints(q)
        return a.startswith(f"{x} plus {y} is {x + y}.") and f"is {spell(x + y)}." in a
    if task in ("repeat", "reverse"):
        words = q.split(": ", 1)[1].rstrip(".").split()
        said = re.findall(r": ([a-z ]+)\.", a)
        want = [words, words] if task == "repeat" else [words, words[::-1]]
        return [s.split() for s in said] == want
    if task == "days":
        names = listed(a)
        cycle = _DAYS if names[0] in _DAYS else _MONTHS
        start = cycle.index(names[0])
        ok = names == [cycle[(start + i) % len(cycle)] for i in range(len(names))]
        if cycle is _DAYS:
            n, after = ints(q)[0], q.rstrip("?.").split()[-1]
            return ok and len(names) == n and names[0] == _DAYS[(_DAYS.index(after) + 1) % 7]
        first, last = re.findall(r"[A-Z][a-z]+", q.split(" ", 1)[1])[-2:]
        return ok and (names[0], names[-1]) == (first, last)
    if task == "letters":
        first, last = re.findall(r"\b([a-z])\b", q)[-2:]
        return listed(a) == list(_LETTERS[_LETTERS.index(first) : _LETTERS.index(last) + 1])
    if task == "note":
        name = re.search(r"\b([A-Z][a-z]+) (about|a note)", q)
        topic = q.rstrip(".").split()[-1]
        return bool(name) and a.startswith(f"Dear {name[1]},") and f"about the {topic}." in a
    if task == "capital":
        country = q.rstrip("?.").split()[-1]
        return a == f"The capital of {country} is {_CAPITALS[country]}. " + (
            f"{_CAPITALS[country]} is the capital city of {country}."
        )
    raise AssertionError(f"no rule for task {task}")


def test_a_seed_draws_the_same_conversations_and_every_answer_follows_its_rule() -> None:
    convs = conversations(7, 1500)
    assert convs == conversations(7, 1500) != conversations(8, 1500)
    assert conversations(7, 10) == convs[:10]  # a prefix of the same draw
    assert set(Counter(t for t, _ in convs)) == set(TASKS)
    for task, (user, assistant) in convs:
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        assert follows_rule(task, user["content"], assistant["content"]), (task, user, assistant)
    # the checks fail a wrong answer
    task, (user, assistant) = next(c for c in convs if c[0] == "count_up")
    assert not follows_rule(task, user["content"], assistant["content"].replace(", ", ", 0, ", 1))
    assert [spell(n) for n in (0, 13, 20, 21, 40, 99)] == [
        "zero", "thirteen", "twenty", "twenty-one", "forty", "ninety-nine",
    ]  # fmt: skip


def test_answers_are_long_enough_to_draft_and_the_slot_words_one_token_each(
    tokenizer: tiny_models.PreTrainedTokenizerFast,
) -> None:
    assert set(_NOUNS) <= set(tiny_models._WORDS)
    assert all(len(tokenizer.encode(" " + w)) == 1 for w in _NOUNS)
    lengths = [sum(encode(tokenizer, c)[1]) for _, c in conversations(CORPUS_SEED, 600)]
    assert statistics.median(lengths) >= 40
    assert sum(25 <= n <= 110 for n in lengths) >= 0.95 * len(lengths)
    ids, mask = encode(tokenizer, conversations(CORPUS_SEED, 1)[0][1])
    answer = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert answer.endswith("<|im_end|>")  # the mask covers the turn's end: the model learns it


def test_prompt_files_are_planner_rows_of_a_user_turn_and_held_out_is_unseen(
    tmp_path: Path,
) -> None:
    files = write_prompts(tmp_path / "a", train=300, held_out=60)
    again = write_prompts(tmp_path / "b", train=300, held_out=60)
    assert files.train.read_bytes() == again.train.read_bytes()
    assert files.held_out.read_bytes() == again.held_out.read_bytes()
    data = DataConfig(paths=[str(files.train)])
    rows = {}
    for path in (files.train, files.held_out):
        for line in path.read_text().splitlines():
            raw = json.loads(line)
            row = parse_row(raw, None, data)
            assert row.reason is None and row.messages is not None, row
            assert [m["role"] for m in row.messages] == ["user"]
            rows[raw["id"]] = raw["messages"][0]["content"]
    train_q = [q for k, q in rows.items() if k.startswith("train-")]
    held_q = [q for k, q in rows.items() if k.startswith("held-out-")]
    assert len(train_q) == 300 and len(held_q) == 60 == len(set(held_q))
    assert train_q == [c[0]["content"] for _, c in conversations(1235, 300)]
    corpus = {c[0]["content"] for _, c in conversations(CORPUS_SEED, corpus_size())}
    assert not set(held_q) & (set(train_q) | corpus)
    assert held_q == [c[0]["content"] for _, c in held_out_conversations(60, exclude=train_q)]


def test_training_a_few_steps_lowers_the_loss_and_gives_the_same_weights_twice(
    tokenizer: tiny_models.PreTrainedTokenizerFast,
) -> None:
    config = TrainConfig(steps=12, batch=4, lr=3e-3, warmup=2)

    def trained() -> tuple[dict[str, torch.Tensor], float]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            tiny_models.llama_config(tokenizer, hidden=64, layers=2), dtype=torch.float32
        )
        stats = train(model, tokenizer, config)
        assert stats.steps == 12 and stats.tokens > 12 * 4 * 25
        return model.state_dict(), stats.final_loss

    (first, loss), (second, _) = trained(), trained()
    assert loss < 6.4  # the mean of its 12 steps; ln(1024) = 6.9 at the start
    assert all(torch.equal(first[k], second[k]) for k in first)
