"""`kvslim experiment gqa`, the GQA uptraining study: `study.py` runs and records it (its MLA arms
built by `mla_arms.py`, their decode timing against GQA by `decode.py`), `goals.py` checks the
goals against the records, `plots.py` and `report.py` write docs/gqa-uptraining.md."""
