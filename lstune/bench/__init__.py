"""`lstune bench`: measured step time, throughput, MFU, memory and longest sequence, against plain Hugging Face
and against the estimate (docs/bench.md).

    options.py      the bench's own options (BenchOptions)
    rungs.py        the configurations: ALST Table 1's ladder (hf → tiled loss → tiled MLP → offload → ...)
    run.py          run_bench: the order of trials, searches and files
    runner.py       each trial in a fresh process, with a time limit and a host-memory cap
    trial.py        what a trial process does: lstune train's step (or plain HF's) on random tokens
    search.py       the longest sequence: exponential, then binary search
    metrics.py      tokens/s, TFLOP/s, MFU, the estimate's error (FLOPs from lstune.estimate.flops)
    rates.py        the device's kernel rates (the ideal step time)
    fingerprint.py  hardware and versions, read without starting CUDA
    report.py       bench.json, bench.md; plots.py the PNGs
    outputs.py      the output folder: checked before any trial, only the bench's own names written (its record)

Sits above `train` (a trial runs train's step) and below `cli`; nothing here imports rich or typer.
"""
