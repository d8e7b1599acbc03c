"""Export a store to the offline formats of the released drafter trainers, SpecForge 0.2.0 and
vLLM speculators 0.9.0 (`python -m cluster export`; layouts, training commands, and the
trainers' sources they were read from: docs/using-the-data.md).

Every format streams committed, written samples through `HiddenStatesIterable` and names files
by the store's global sample index; every file is written whole or not at all, so an
interrupted export resumes; `export.json` records the store (`store_id`), manifest, format and
what was written, and a directory made from anything else is refused (`ExportConflict`).

    run.py          the export: the store walked (or followed), each sample to its format
    base.py         TrainerFormat, the hooks a format implements
    specforge.py    SpecForge: one torch dict per sample, bf16, exactly 3 aux layers
    speculators.py  speculators: a HF dataset, token_freq.pt, a safetensors file per sample
    registry.py     the formats by --format name
    record.py       export.json: identity, conflicts, the samples exported
    files.py        atomic files, the temporaries of interrupted runs, the directory's lock
    command.py      the command line's export, as an exit status
    sglang_draft.py the way back: a draft speculators trained on such an export, made into the
                    EAGLE-3 draft SGLang serves (`python -m cluster draft-convert`)
"""
