"""A study's three files, written only from its recorded result: <stem>.json (every number),
<stem>.png (its plot) and <stem>.md (its markdown, which shows the plot), in one folder."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def write_report_files(result, out_dir: str | Path, stem: str, plot: Callable,
                       format_markdown: Callable) -> list[Path]:
    """`result.to_dict()` as JSON, `plot(result, path)`, `format_markdown(result, image)`;
    returns the paths: JSON, markdown, PNG."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"]
    paths[0].write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    plot(result, paths[2])
    paths[1].write_text(format_markdown(result, paths[2].name))
    return paths


def run_preamble(result) -> str:
    """A report's opening after its title: the command that made it, then machine and date."""
    m = result.machine
    machine = (f"Machine: {m.get('cpu')}, {m.get('cores')} cores, torch {m.get('torch')}. "
               if m else "")
    return ((f"```bash\n{result.command}\n```\n\n" if result.command else "")
            + f"{machine}{'Date: ' + result.date if result.date else ''}\n\n")
