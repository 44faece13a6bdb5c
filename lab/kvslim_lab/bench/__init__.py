"""`kvslim bench`: the subcommands (throughput, latency, capacity, profile, kernels, serve, report)
and the pieces they are built from (workloads, engine runners, the HF and llama.cpp peers, machine
info). The studies in `experiments/` and the probes in `benchmarks/` reuse them; a measurement only
one study needs lives in that study's package (docs/architecture.md)."""
