"""A trainer's stand-in that follows a running job: `python -m tests.helpers.follower URL DIR
[--stop-after N]`. For each sample it appends the sample id and its rows' checksum to
DIR/seen.jsonl, then saves the reader's cursor to DIR/cursor.json (as a trainer checkpoints
after a step); started again, it resumes from that cursor. With --stop-after N it SIGKILLs
itself after its N-th sample. DIR/following appears once it follows; at the end it writes why
following ended to DIR/ended.txt."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from pathlib import Path

from hsx_store.reader import HiddenStatesIterable


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("out", type=Path)
    parser.add_argument("--stop-after", type=int)
    args = parser.parse_args()
    reader = HiddenStatesIterable(args.url, follow=True, poll_s=0.2, max_poll_s=1.0)
    cursor = args.out / "cursor.json"
    if cursor.exists():
        reader.load_state_dict(json.loads(cursor.read_text()))
    (args.out / "following").touch()
    with (args.out / "seen.jsonl").open("a") as seen:
        for n, sample in enumerate(reader, 1):
            digest = hashlib.sha256(sample["final_hidden_states"].float().numpy().tobytes())
            seen.write(json.dumps([sample["sample_id"], digest.hexdigest()]) + "\n")
            seen.flush()
            partial = cursor.with_suffix(".tmp")
            partial.write_text(json.dumps(reader.state_dict()))
            partial.replace(cursor)
            if n == args.stop_after:
                os.kill(os.getpid(), signal.SIGKILL)
    (args.out / "ended.txt").write_text(str(reader.ended))


if __name__ == "__main__":
    main()
