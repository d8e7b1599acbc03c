"""Assistant loss masks from one rendering per conversation, for templates without markers.

    turns = TurnShape.learn(render, special_tokens)        # once per template
    spans = turns.assistant_spans(text, messages, render)   # per row: [start, end) characters
    mask = token_mask(spans, offsets)                       # per row: 1 on tokens in a span

A turn's span is every character the template writes for it past its header, up to and
including its turn end's last special token (ChatML's `<|im_end|>`, not the `\n` after it):
its content, and its reasoning and tool-call markup where it has them. A template's header and
turn end are learned once from probe conversations. In the row's one rendering a turn starts
past its header, where every assistant turn has exactly one (after the messages before it);
else past the rendering of the conversation before it with the generation prompt; it ends at
its first turn end. A turn found neither way is rejected (`NOT_FOUND`), as is one whose slow
tokenizer merges tokens across a span's edge (`BOUNDARY_MERGED`): never a guessed mask.

Design: docs/design/planning.md.
"""

from __future__ import annotations

import bisect
import contextlib
import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

NOT_FOUND = (
    "cannot find where assistant turn {turn} starts and ends in the chat template's rendering "
    "(after its header or the conversation before it, up to its turn end); cannot mark its "
    "tokens (use loss_mask: all or a template with {{% generation %}} markers)"
)
BOUNDARY_MERGED = (
    "the tokenizer merges tokens across an edge of assistant turn {turn} and gives no character "
    "offsets (not a fast tokenizer); cannot mark its tokens (use loss_mask: all or a template "
    "with {{% generation %}} markers)"
)
# Probe contents: text no tokenizer merges with its neighbours in a surprising way, and that no
# template transforms (no leading/trailing space, no markup).
_PROBE_A, _PROBE_B, _PROBE_U = "HSXPROBEASSISTANT", "HSXPROBEUSER2", "HSXPROBEUSER1"

Render = Callable[[list[dict[str, Any]], bool], str]  # (messages, add_generation_prompt) -> text
Span = tuple[int, int]


class TemplateShapeError(ValueError):
    """The template's assistant turns could not be learned from probe conversations."""


@dataclass(frozen=True)
class TurnShape:
    header: str  # what the template writes before an assistant turn's own tokens
    end: str  # what closes an assistant turn, up to its last special token ("": none)
    generation_prompt: bool  # add_generation_prompt changes the rendering (the template has one)

    @classmethod
    def learn(cls, render: Render, special_tokens: Sequence[str]) -> TurnShape:
        """From probe conversations: as they are, then after a system message (for templates
        that want one first). Raises TemplateShapeError naming what did not fit."""
        problems = []
        for opening in ([], [{"role": "system", "content": "HSXPROBESYSTEM"}]):
            try:
                return cls._learn(render, special_tokens, opening)
            except Exception as exc:  # a template is user code: any error means "not this way"
                problems.append(f"{type(exc).__name__}: {exc}")
        raise TemplateShapeError("; ".join(problems))

    @classmethod
    def _learn(
        cls, render: Render, special_tokens: Sequence[str], opening: list[dict[str, Any]]
    ) -> TurnShape:
        user = [*opening, {"role": "user", "content": _PROBE_U}]
        turn = [*user, {"role": "assistant", "content": _PROBE_A}]
        asked, prompted = render(user, False), render(user, True)
        last = render(turn, False)
        more = render([*turn, {"role": "user", "content": _PROBE_B}], False)
        at_last, at_more = last.find(_PROBE_A), more.find(_PROBE_A)
        if at_last < 0 or at_more < 0:
            raise TemplateShapeError("an assistant turn does not render its content")
        # The header starts where the conversation before it would have ended (past any text
        # that only closes a conversation, e.g. an eos token). With a generation prompt it is
        # what that prompt and a turn inside a conversation both open with: what a template
        # writes after it (Kimi's "<think></think>", Qwen3's empty think block) is the model's
        # to write, so the turn's; a prompt that opens the reasoning too (Qwen3-Thinking's
        # "<think>\n") has only its common part as the header of earlier turns.
        opened = last[:at_last]
        base = len(os.path.commonprefix([asked, opened]))  # noqa: RUF071
        header = opened[base:]
        prompt, inside = prompted[base:], more[base:at_more]
        if prompted != asked and (inside.startswith(prompt) or prompt.startswith(inside)):
            header = os.path.commonprefix([prompt, inside, header])  # noqa: RUF071
        after = [last[at_last + len(_PROBE_A) :], more[at_more + len(_PROBE_A) :]]
        common = os.path.commonprefix(after)  # noqa: RUF071
        return cls(header, common[: _after_last_special(common, special_tokens)], prompted != asked)

    def assistant_spans(
        self, text: str, messages: list[dict[str, Any]], render: Render
    ) -> list[Span] | str:
        """The character span of each assistant turn in `text` (the rendering of `messages`
        by `render`), or a reject reason: from its start (`_turn_start`) to its first turn
        end (for a template without one: to the end of its content, if it holds nothing
        else)."""
        spans: list[Span] = []
        cursor = 0
        assistants = sum(m["role"] == "assistant" for m in messages)
        one_header_each = bool(self.header) and text.count(self.header) == assistants
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                # Past its content: a header written inside it (quoted markup) is not a turn's.
                content = message["content"]
                at = text.find(content, cursor) if isinstance(content, str) and content else -1
                cursor = at + len(content) if at >= 0 else cursor
                continue
            start = self._turn_start(text, messages[:k], render, cursor, one_header_each)
            span = self._turn_span(text, start, message) if start >= 0 else None
            if span is None:
                return NOT_FOUND.format(turn=len(spans))
            spans.append(span)
            cursor = span[1]
        return spans

    def _turn_start(
        self,
        text: str,
        before: list[dict[str, Any]],
        render: Render,
        cursor: int,
        one_header_each: bool,
    ) -> int:
        """Where an assistant turn's own tokens start: past its header, where every assistant
        turn has exactly one; else past the rendering of the conversation before it with the
        generation prompt, where that is how `text` begins. -1: neither."""
        at = text.find(self.header, cursor) if one_header_each else -1
        if at >= 0:
            return at + len(self.header)
        if before:
            with contextlib.suppress(Exception):  # a template is user code
                prompt = render(before, True) + ("" if self.generation_prompt else self.header)
                if len(prompt) >= cursor and text.startswith(prompt):
                    return len(prompt)
        return -1

    def _turn_span(self, text: str, start: int, message: dict[str, Any]) -> Span | None:
        if self.end:
            at = text.find(self.end, start)
            return (start, at + len(self.end)) if at >= 0 else None
        # No turn end to look for: only a turn of nothing but its content can be placed.
        content = message["content"]
        if not isinstance(content, str) or message.keys() - {"role", "content"}:
            return None
        for written in dict.fromkeys((content, content.strip())):  # as written, then trimmed
            at = text.find(written, start)
            if at >= 0:
                return start, at + len(written)
        return None


def _after_last_special(text: str, special_tokens: Sequence[str]) -> int:
    """The index just past the last special token in `text` (0: none)."""
    end = 0
    for token in special_tokens:
        at = text.rfind(token) if token else -1
        if at >= 0:
            end = max(end, at + len(token))
    return end


def token_mask(spans: Sequence[Span], offsets: Any, count: int) -> np.ndarray:
    """1 for every one of `count` tokens whose characters overlap a span. `offsets`: the fast
    tokenizer's per-token (start, end), in order, or its Encoding, asked for the tokens at the
    spans' edges only (converting every token's offsets to Python costs more than the rest)."""
    if hasattr(offsets, "char_to_token"):
        edges = [
            (offsets.char_to_token(a), offsets.char_to_token(b - 1)) for a, b in spans if b > a
        ]
        if all(first is not None and last is not None for first, last in edges):
            mask = np.zeros(count, np.uint8)
            for first, last in edges:
                mask[first : last + 1] = 1
            return mask
        offsets = offsets.offsets  # an edge on a character no token covers: the general way
    mask = np.zeros(count, np.uint8)
    for start, end in spans:  # from the first token ending after the start to the last one
        if end <= start:
            continue  # an empty turn with no end token: nothing to mark
        first = bisect.bisect_right(offsets, start, key=operator.itemgetter(1))  # starting
        stop = bisect.bisect_left(offsets, end, key=operator.itemgetter(0))  # before the end
        mask[first:stop] = 1
    return mask


def token_mask_by_prefix(
    spans: Sequence[Span],
    text: str,
    ids: list[int],
    tokenize: Callable[[list[str]], list[list[int]]],
) -> list[int] | str:
    """The same mask without offsets: each span edge's token index is the length of the
    tokenization of the text before it, which must be a prefix of the whole's."""
    edges = sorted({e for span in spans for e in span})
    bounds = {}
    for edge, prefix in zip(edges, tokenize([text[:e] for e in edges]), strict=True):
        if ids[: len(prefix)] != prefix:
            turn = next(t for t, span in enumerate(spans) if edge in span)
            return BOUNDARY_MERGED.format(turn=turn)
        bounds[edge] = len(prefix)
    mask = [0] * len(ids)
    for start, end in spans:
        mask[bounds[start] : bounds[end]] = [1] * (bounds[end] - bounds[start])
    return mask
