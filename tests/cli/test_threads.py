"""The CLI shortens how long OpenMP threads spin while they wait (see
benchmarks/shared_cores.py), unless the user chose a policy or a spin count; it must be in the
environment before torch is imported."""
import os
import subprocess
import sys

PROBE = ("import os, sys; import kvslim.cli.main; "
         "print(os.environ.get('GOMP_SPINCOUNT', '-'), os.environ.get('OMP_WAIT_POLICY', '-'), "
         "'torch' in sys.modules)")


def probe(**env):
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    r = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True,
                       text=True, timeout=120, check=True)
    return r.stdout.split()


def test_cli_sets_a_short_spin_before_torch_loads():
    assert probe() == ["1000", "-", "False"]


def test_a_policy_or_spin_count_the_user_set_is_kept():
    assert probe(OMP_WAIT_POLICY="PASSIVE") == ["-", "PASSIVE", "False"]
    assert probe(GOMP_SPINCOUNT="50") == ["50", "-", "False"]
