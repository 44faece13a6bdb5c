"""`kvslim experiment gqa`, the GQA uptraining study: `study.py` runs and records it, `goals.py`
checks the goals against the records, `plots.py` and `report.py` write docs/gqa-uptraining.md."""
