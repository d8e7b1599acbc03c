"""Assistant loss masks from one rendering per conversation, for templates without markers.

    turns = TurnShape.learn(render, special_tokens)   # once per template
    spans = turns.assistant_spans(text, messages)      # per row: [start, end) character spans
    mask = token_mask(spans, offsets)                  # per row: 1 on tokens overlapping a span

A turn's span is its content plus the turn end up to its last special token (ChatML's
`<|im_end|>`, not the `\\n` after it). A template's header and turn end are learned once from
probe conversations. A row whose assistant turns do not render as header + content + turn end
is rejected (`NOT_AS_WRITTEN`), as is one whose slow tokenizer merges tokens across a span's
edge (`BOUNDARY_MERGED`): never a guessed mask.

Design: docs/design/planning.md.
"""

from __future__ import annotations

import bisect
import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

NOT_AS_WRITTEN = (
    "the chat template does not render assistant turn {turn} as written (header, content, turn "
    "end); cannot mark its tokens (use loss_mask: all or a template with {{% generation %}} "
    "markers)"
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
    header: str  # what precedes an assistant turn's content
    end: str  # what follows its content and is part of the turn (up to the last special token)
    end_glue: str  # what follows `end` after every assistant turn (never masked)
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
        last = render(turn, False)
        more = render([*turn, {"role": "user", "content": _PROBE_B}], False)
        at = last.find(_PROBE_A)
        opened = last[: at + len(_PROBE_A)]
        if at < 0 or not more.startswith(opened):
            raise TemplateShapeError("an assistant turn does not render its content as written")
        # The header starts where the conversation before it would have ended (past any text
        # that only closes a conversation, e.g. an eos token).
        asked = render(user, False)
        before = os.path.commonprefix([asked, last[:at]])  # noqa: RUF071
        header = last[len(before) : at]
        common = os.path.commonprefix([last[len(opened) :], more[len(opened) :]])  # noqa: RUF071
        cut = _after_last_special(common, special_tokens)
        return cls(header, common[:cut], common[cut:], render(user, True) != asked)

    def assistant_spans(self, text: str, messages: list[dict[str, Any]]) -> list[Span] | str:
        """The character span of each assistant turn in `text` (the rendering of `messages`),
        or a reject reason."""
        spans: list[Span] = []
        cursor, turn = 0, 0
        for message in messages:
            content = message["content"]
            if message["role"] != "assistant":
                at = text.find(content, cursor) if content else -1
                cursor = at + len(content) if at >= 0 else cursor
                continue
            for written in dict.fromkeys((content, content.strip())):  # as written, then trimmed
                at = text.find(self.header + written + self.end + self.end_glue, cursor)
                if at >= 0:
                    start = at + len(self.header)
                    spans.append((start, start + len(written) + len(self.end)))
                    cursor = start + len(written)
                    break
            else:
                return NOT_AS_WRITTEN.format(turn=turn)
            turn += 1
        return spans


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
