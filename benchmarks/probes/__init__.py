"""Kernel probes: one-off measurements that decided a design (an attention kernel, a thread pool, a
compiled step, weight-first against packed linears, a static draft cache). Each still runs
(``python -m benchmarks.probes.<name> --help``); none backs a README figure."""
