"""Flag values are checked before the model loads: a mistake answers with one line and exit 2,
and the "loading" line (printed just before weights are read) never appears. Each flag is
checked in this process; what needs a real process (exit codes of a run, a fresh home) starts
one."""
import subprocess
import sys

import pytest

LOADING = "kvslim: loading"


def kvslim(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvslim.cli.main", *args], capture_output=True,
                          text=True, timeout=600, env=env)


def assert_refused_before_loading(r, message):
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"kvslim generate: error: {message}"]
    assert LOADING not in r.stderr and r.stdout == ""


def kvslim_here(capsys, *args) -> subprocess.CompletedProcess:
    """The CLI in this process (a new interpreter per flag would cost seconds of imports each);
    argparse's refusals exit, kvslim's return 2."""
    from kvslim.cli.main import main
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


@pytest.mark.parametrize("flags,message", [
    (["--max-tokens", "-1"], "--max-tokens: max_tokens must be at least 1, got -1"),
    (["--seed", str(2**70)], f"--seed: seed must be an integer in [-2**63, 2**64 - 1], got {2**70}"),
    (["--top-p", "0"], "--top-p: top_p must be in (0, 1], got 0.0"),
    (["--kv-cache-memory", "1KiB"],
     "kv_cache_memory=1024 bytes is too small for one block of 16 tokens (4096 bytes for this "
     "model)"),
    (["--kv-cache-memory", "lots"],
     "cannot parse memory size 'lots'; use e.g. 512MiB, 2GiB or 1.5GB"),
    (["--block-size", "0"], "block_size must be positive, got 0"),
    (["--threads", "0"], "--threads must be at least 1, got 0"),
    (["--speculative-config", "{method: ngram}"],
     "--speculative-config is not valid JSON: Expecting property name enclosed in double quotes: "
     "line 1 column 2 (char 1)"),
    (["--speculative-config", "[3]"],
     "--speculative-config must be a JSON object, e.g. "
     "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
     "num_speculative_tokens must be between 1 and 16, got 0"),
])
def test_bad_flag_is_refused_before_loading(hf_checkpoints, flags, message, capsys):
    r = kvslim_here(capsys, "generate", "--model", str(hf_checkpoints["gqa"]), "--prompt", "x",
                    "--raw", *flags)
    assert_refused_before_loading(r, message)


def test_generate_with_speculative_decoding(hf_checkpoints, capsys):
    args = ["generate", "--model", str(hf_checkpoints["gqa"]), "--prompt", "a b a b a b a",
            "--raw", "--max-tokens", "12", "--kv-cache-memory", "4MiB", "--temperature", "0"]
    plain = kvslim_here(capsys, *args)
    fast = kvslim_here(capsys, *args, "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 4}')
    assert plain.returncode == 0 and fast.returncode == 0, fast.stderr
    assert fast.stdout == plain.stdout and plain.stdout.strip()


def test_loading_is_announced(hf_checkpoints):
    r = kvslim("generate", "--model", str(hf_checkpoints["gqa"]), "--prompt", "x", "--raw",
               "--max-tokens", "2", "--kv-cache-memory", "4MiB")
    assert r.returncode == 0, r.stderr
    assert f"{LOADING} {hf_checkpoints['gqa']} ..." in r.stderr.splitlines()


def test_default_model_is_not_imported_to_refuse_a_flag(smollm2_gguf, tmp_path):
    """The default model not imported yet: its GGUF header gives the config, so a too-small
    cache is refused before the import (tens of seconds) starts."""
    import os
    env = dict(os.environ, KVSLIM_HOME=str(tmp_path))
    r = kvslim("generate", "--prompt", "x", "--kv-cache-memory", "1KiB", env=env)
    assert_refused_before_loading(
        r, "kv_cache_memory=1024 bytes is too small for one block of 16 tokens (737280 bytes "
           "for this model)")
    assert "importing" not in r.stderr and not (tmp_path / "models").exists()
