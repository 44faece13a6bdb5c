"""The scale-out tests start `kvslim serve` processes as the server tests do: the same
LiveServer (tests/server/live_server.py), importable from here too."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
