"""`kvslim experiment speculative`, when speculative decoding wins: `records.py` the settings and
the recorded runs, `workloads.py` the prompts, `study.py` runs them, `thresholds.py` measures the
adaptivity thresholds from the runs (the study's second phase runs with them), `report.py` writes
docs/speculative.md."""
