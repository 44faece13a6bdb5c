"""Which learned drafter a directory holds, from the weights file it has."""
from __future__ import annotations

from pathlib import Path

from kvslim.drafters import eagle, medusa
from kvslim.errors import KvslimError


def drafter_kind(path: str | Path) -> str:
    """"medusa" (medusa_lm_head.safetensors) or "eagle" (model.safetensors beside an EAGLE
    config.json); a one-line error for anything else."""
    path = Path(path)
    if (path / medusa.WEIGHTS_FILE).is_file():
        return "medusa"
    if (path / eagle.WEIGHTS_FILE).is_file() and (path / eagle.CONFIG_FILE).is_file():
        return "eagle"
    raise KvslimError(f"{path} holds no drafter made by kvslim train-drafter (neither "
                      f"{medusa.WEIGHTS_FILE} nor {eagle.WEIGHTS_FILE})")
