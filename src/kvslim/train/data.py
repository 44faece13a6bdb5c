"""Token streams for training and evaluation: a text file tokenized once and cached as uint16/32
numpy arrays, and deterministic random windows over it."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kvslim.errors import KvslimError
from kvslim.paths import kvslim_home

LINES_PER_CHUNK = 2000


def cache_dir() -> Path:
    return kvslim_home() / "tokens"


def tokenize_file(path: str | Path, tokenizer, show_progress: bool = True) -> np.ndarray:
    """All tokens of a text file (newlines kept), cached by file identity and tokenizer."""
    path = Path(path)
    if not path.is_file():
        raise KvslimError(f"data file not found: {path}")
    stat = path.stat()
    if stat.st_size == 0:
        raise KvslimError(f"data file is empty: {path}")
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|"
                         f"{tokenizer.fingerprint}".encode()).hexdigest()[:24]
    cached = cache_dir() / f"{key}.npy"
    if cached.is_file():
        return np.load(cached, mmap_mode="r")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    chunks = ["".join(lines[i:i + LINES_PER_CHUNK]) for i in range(0, len(lines), LINES_PER_CHUNK)]
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32
    parts = []
    for chunk in tqdm(chunks, desc=f"tokenizing {path.name}", unit="chunk",
                      disable=not show_progress or len(chunks) < 4):
        parts.append(np.asarray(tokenizer.encode(chunk, add_special_tokens=False), dtype=dtype))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
    if tokens.size < 2:
        raise KvslimError(f"data file has too little text to train or evaluate on: {path}")
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.stem}.{os.getpid()}.tmp.npy")
    np.save(tmp, tokens)
    tmp.replace(cached)
    return tokens


def random_windows(tokens: np.ndarray, batch: int, seq_len: int, seed: int, step: int
                   ) -> torch.Tensor:
    """[batch, seq_len + 1] windows; the same (seed, step) always gives the same batch, which is
    what makes `--resume` exact."""
    if tokens.size <= seq_len + 1:
        raise KvslimError(f"data has {tokens.size} tokens, fewer than one window of {seq_len + 1}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, tokens.size - seq_len - 1, size=batch)
    return torch.from_numpy(np.stack([tokens[s:s + seq_len + 1].astype(np.int64) for s in starts]))


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """Fixed, evenly spaced, non-overlapping windows for a cheap validation loss."""
    n = min(max_windows, (tokens.size - 1) // (seq_len + 1))
    if n <= 0:
        raise KvslimError(f"validation data has {tokens.size} tokens, fewer than one window")
    starts = np.linspace(0, tokens.size - seq_len - 1, n).astype(np.int64)
    return torch.from_numpy(np.stack([tokens[s:s + seq_len + 1].astype(np.int64) for s in starts]))
