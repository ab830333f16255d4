"""The accelerator session (device_run.sh) and the checks it runs: the host copies, exactness
of prefill and the engine, access rates, kernels."""
