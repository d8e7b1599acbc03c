"""What a server's calibration found (actors/calibration.py), which every later dump of that
server start is checked against (actors/dump_checks.py): where the probe left its dump counter.

Apart from both: calibration checks its probe's dump with the dump checks, and the dump checks
judge a dump stale by this.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Calibration:
    offset: int  # the probe's dump counter: its rank's real dumps all come after it
    probe_tokens: int
    seconds: float
    # The DP rank that served the probe (None: the server has one). Counters are per DP rank:
    # the other ranks had captured nothing before the probe, and start at 0 after it.
    dp_rank: int | None = None
    quantized: str | None = None  # the dumps' rows come quantized by the server ("fp8_e4m3")

    def precedes_probe(self, meta: dict) -> bool:
        """The dump was numbered at or before the probe on the probe's own rank: not one of
        this server start's requests."""
        return meta.get("dp_rank") == self.dp_rank and int(meta.get("index", -1)) <= self.offset

    def describe(self) -> str:
        rank = "" if self.dp_rank is None else f" on DP rank {self.dp_rank}"
        return f"probe dump {self.offset}{rank}"
