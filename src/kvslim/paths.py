"""Where kvslim keeps what it derives on this machine (token caches, imported models)."""
from __future__ import annotations

import os
from pathlib import Path


def kvslim_home() -> Path:
    """`$KVSLIM_HOME`, or ~/.cache/kvslim. Read on every call so tests and users can redirect it."""
    return Path(os.environ.get("KVSLIM_HOME") or Path.home() / ".cache" / "kvslim")
