"""The CLI makes OpenMP threads sleep while they wait (see benchmarks/shared_cores.py), unless
the user chose a policy; it must be in the environment before torch is imported."""
import os
import subprocess
import sys

PROBE = ("import os, sys; import kvslim.cli.main; "
         "print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)")


def probe(**env):
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    r = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True,
                       text=True, timeout=120, check=True)
    return r.stdout.split()


def test_cli_sets_passive_wait_before_torch_loads():
    assert probe() == ["PASSIVE", "False"]


def test_a_policy_the_user_set_is_kept():
    assert probe(OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "False"]
