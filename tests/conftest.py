import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from checkpoints import VARIANTS, write_checkpoint  # noqa: E402


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
