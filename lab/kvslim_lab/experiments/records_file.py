"""A study's records: one JSON file of its finished arms (dataclasses keyed "model/arm"),
rewritten whole through a temporary file after each arm, so that an interrupted study resumes
where it stopped and a reader never sees half a file."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path


def load_records(path: Path, cls) -> dict:
    if not path.is_file():
        return {}
    return {k: cls(**v) for k, v in json.loads(path.read_text()).items()}


def save_records(path: Path, records: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({k: asdict(v) for k, v in records.items()}, indent=1))
    tmp.replace(path)
