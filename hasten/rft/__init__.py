"""RFT: rejection-sampling data generation, SFT on what was kept, held-out test, profile comparison.

    datagen.py     sample oversample completions per question, keep the correct ones (hasten rft datagen)
    data.py        the [question, answer, reasoning] JSON records: load (checked), write (atomic)
    prompts.py     question -> the task's prompt; a model loaded for generation (LoRA merged)
    batches.py     SFT micro-batches: packed rows with a block mask, or padded; their loss
    sft.py         the SFT loop (hasten sft): LoRA or full, accumulation, schedule, speed switches
    profiles.py    plain / conservative / balanced / aggressive, and config layering
    evaluation.py  greedy held-out accuracy and answer rate (hasten rft test)
    compare.py     every profile on the same records: time, speed-up, accuracy (hasten rft compare)
    cli.py         the command lines

See docs/rft.md.
"""
