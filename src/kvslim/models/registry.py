"""Moved to `kvslim.formats.registry`: resolving a model name may import a GGUF file, which is a
checkpoint format's job. This forwarder stays only until the last importers of the old path
(engine/llm.py, bench/report.py, experiments/gqa.py) import the new one; then delete it."""
from kvslim.formats.registry import default_model_dir, resolve_model  # noqa: F401
