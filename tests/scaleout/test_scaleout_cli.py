"""`kvslim serve`'s scale-out flags without starting anything: each mistake is one line and
exit 2, Ray missing says how to install it (run here with `ray` hidden, so this holds with or
without the extra), and neither `from kvslim import LLM` nor a single-engine server loads Ray."""
from __future__ import annotations

import subprocess
import sys

import pytest
from checkpoints import write_checkpoint

from kvslim.cli.main import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint("gqa", tmp_path_factory.mktemp("dp-cli") / "gqa")


def serve(tiny, capsys, *flags: str) -> tuple[int, str]:
    code = main(["serve", str(tiny), "--device", "cpu", "--dtype", "float32",
                 "--kv-cache-memory", "2MiB", *flags])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("flags, message", [
    (("--data-parallel-size", "0"), "--data-parallel-size must be at least 1"),
    (("--data-parallel-size", "2", "--replica-cpus", "0"), "--replica-cpus must be positive"),
    (("--data-parallel-size", "2", "--lora-modules", "a=/nowhere"),
     "not served by data-parallel replicas"),
])
def test_bad_scale_out_flags_are_one_line(tiny, capsys, flags, message):
    code, err = serve(tiny, capsys, *flags)
    assert code == 2 and message in err and len(err.splitlines()) == 1


def test_unknown_routing_is_argparse_error(tiny, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["serve", str(tiny), "--routing", "random"])
    assert exit.value.code == 2 and "--routing" in capsys.readouterr().err


def test_without_ray_the_error_says_how_to_install_it(tiny, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)            # `import ray` fails
    code, err = serve(tiny, capsys, "--data-parallel-size", "2")
    assert code == 2 and len(err.splitlines()) == 1
    assert "pip install 'kvslim[ray]'" in err


def test_ray_is_loaded_only_for_replicas():
    script = ("import sys\n"
              "from kvslim import LLM\n"
              "import kvslim.cli.serve_cmds, kvslim.scaleout.options, kvslim.scaleout.router\n"
              "import kvslim.server.app\n"
              "print('ray' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "False", result.stderr
