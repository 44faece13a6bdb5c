"""The models a study runs on, named as users name them: a model directory, a .gguf file, or
"smollm2" (the embedded default model). A GGUF file is imported to float32 once under the
study's work directory and reused by every later run."""
from __future__ import annotations

import shutil
from pathlib import Path

from kvslim.errors import KvslimError

DEFAULT_MODEL_ALIASES = ("smollm2", "default")


def model_key(model: str) -> str:
    """The name a model's results and files are kept under."""
    if model in DEFAULT_MODEL_ALIASES:
        return "smollm2"
    return Path(model).stem if model.endswith(".gguf") else Path(model).name


def float_model_source(model: str, work: Path, show_progress: bool
                       ) -> tuple[Path, Path | None]:
    """(the model's float32 directory, the GGUF file it came from or None)."""
    gguf = None
    if model in DEFAULT_MODEL_ALIASES:
        from kvslim.formats.registry import default_model_gguf
        gguf = default_model_gguf()
    elif model.endswith(".gguf"):
        gguf = Path(model)
    if gguf is None:
        if not (Path(model) / "config.json").is_file():
            raise KvslimError(f"model not found: {model} (a model directory, a .gguf file "
                              "or smollm2)")
        return Path(model), None
    float_dir = work / model_key(model) / "float32-import"
    if not (float_dir / "config.json").is_file():
        from kvslim.formats.gguf.importer import import_gguf
        tmp = float_dir.with_name(float_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        import_gguf(gguf, tmp, show_progress=show_progress).rename(float_dir)
    return float_dir, gguf
