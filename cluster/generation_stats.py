"""What a `generate:` job's report says of its generation: counted by the driver as it plans
the responses (cluster/generation_feed.py), shown in the progress line and the final report
(cluster/report.py).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


def covered_seconds(spans: Iterable[tuple[float, float]]) -> float:
    """The wall time during which at least one of the [start, end] spans ran (their union):
    spans that overlap, parts generated at once by one worker or by many, count once."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


@dataclass
class GenerationStats:
    """What the report says of the generation (counted as the driver plans responses)."""

    prompts: int = 0
    parts: int = 0  # queued (or kept from an earlier run) so far
    parts_done: int = 0  # whose responses are planned
    reused_parts: int = 0  # parts whose responses a former run left (not generated again)
    responses: int = 0
    generated_tokens: int = 0
    # Each generated part's wall-clock [start, end], any worker's: the rate is over their union.
    generate_spans: list[tuple[float, float]] = field(default_factory=list)
    finish_reasons: Counter[str] = field(default_factory=Counter)
    rejected: int = 0

    def to_json(self) -> dict[str, Any]:
        seconds = covered_seconds(self.generate_spans)
        rate = self.generated_tokens / seconds if seconds else None
        return {
            "prompts": self.prompts,
            "parts": self.parts,
            "parts_done": self.parts_done,
            "reused_parts": self.reused_parts,
            "responses": self.responses,
            "generated_tokens": self.generated_tokens,
            "generated_tokens_per_s": None if rate is None else round(rate, 1),
            "finish_reasons": dict(self.finish_reasons),
            "rejected": self.rejected,
        }
