"""The experiments of fo_jax, grouped by the question they answer (docs/experiments.md is the
index: what each script answers, its command, how long it runs, its results file).

    decode/       the offloaded decode step and loop against resident
    serving/      the serving engine: throughput, latency, data parallel, automatic offload
    traces/       attention traces, their replay, eviction policies, prefetch, rank imbalance
    accelerator/  the accelerator session (device_run.sh) and the checks it runs
    training/     the small model: training, the MTP layer, export, parity fixtures

Each script runs as a module from the repository root, e.g.
`python -m experiments.decode.decode_bench --smoke`; their results are under
experiments/results/. Not part of the installed package.
"""
