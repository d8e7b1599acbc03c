"""A part's responses are written once by the store itself (hsx_store/generated.py): a later
write of them, a late upload of a claimant lost mid-write or a successor's, leaves the first.
On S3 the same write is a create-only PUT (If-None-Match); the fault campaign's generate jobs
check it there (one object version per part, tools/campaign_generation.py)."""

from __future__ import annotations

from pathlib import Path

import zarr

from hsx_store.generated import GeneratedParts


def test_the_first_responses_of_a_part_stay_and_prompts_may_be_written_again(
    tmp_path: Path,
) -> None:
    keep = GeneratedParts(zarr.open_group(tmp_path / "s.zarr", mode="w", zarr_format=3).store)
    keep.put_responses(0, {"samples": [], "worker": "lost-mid-write"})
    keep.put_responses(0, {"samples": [], "worker": "its-successor"})
    assert keep.responses(0) == {"part": 0, "samples": [], "worker": "lost-mid-write"}
    assert keep.parts() == [0]
    keep.put_prompts(0, [{"prompt_id": "a"}])  # a resumed driver writes a part's prompts again
    keep.put_prompts(0, [{"prompt_id": "a"}, {"prompt_id": "b"}])
    assert len(keep.prompts(0)) == 2
    assert not list((tmp_path / "s.zarr" / "generation").glob("*.partial"))  # none left
