"""`kvslim experiment`: one package per study, each recording a grid of runs and writing a
docs/*.md report with its goal checks from those records. Engine measurements come from `bench/`;
one-off probes live in benchmarks/ at the repository root (docs/architecture.md)."""
