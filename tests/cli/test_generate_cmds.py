"""`kvslim generate` and `kvslim demo` as a user runs them."""
import json
import subprocess
import sys


def kvslim(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "kvslim.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_generate_json_on_a_model_dir(hf_checkpoints):
    r = kvslim("generate", "--model", str(hf_checkpoints["gqa"]), "--prompt", "In the beginning",
               "--raw", "--max-tokens", "5", "--json", "--kv-cache-memory", "4MiB")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 5 and out["finish_reason"] in ("length", "stop")


def test_generate_bad_parameter_is_one_line(hf_checkpoints):
    r = kvslim("generate", "--model", str(hf_checkpoints["gqa"]), "--prompt", "x",
               "--temperature", "-1")
    assert r.returncode == 2
    assert "--temperature: temperature must be a finite number >= 0, got -1.0" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0


def test_default_model_answers(smollm2_dir):
    """A question the model answers decisively (first token 1.6 nats ahead of the next, int8
    or float32 activations). The bare "What is the capital of France?" is a coin toss for
    SmolLM2-135M Q4_1: "The" leads "L" by 0.08 nats in float32 activations and trails it by 0.02
    in int8 ones, where it answers "L'Étoile, la Marseillaise, ..." — as llama.cpp does on the
    same file."""
    r = kvslim("generate", "--prompt", "What is the capital of France? Answer in one sentence.",
               "--max-tokens", "16", "--kv-cache-memory", "64MiB")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_demo_report(smollm2_dir):
    r = kvslim("demo", "--json", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["requests"] == 16 and report["output_tokens"] <= 16 * 6
    assert report["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    assert report["peak_concurrent_sequences"] > 1
    assert report["prefix_cache_hit_tokens"] > 0
    assert 0 < report["blocks_peak_used"] <= report["blocks_total"]


def test_chat_reads_turns_until_exit(hf_checkpoints):
    r = subprocess.run([sys.executable, "-m", "kvslim.cli.main", "chat", "--model",
                        str(hf_checkpoints["gqa"]), "--max-tokens", "4",
                        "--kv-cache-memory", "4MiB"],
                       input="hello\n/reset\nagain\n/exit\n", capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("> ") == 4 and r.stdout.count("s]") == 2   # two answers, timed


def test_generate_with_a_lora_adapter(hf_checkpoints, tmp_path):
    """--lora DIR answers with the adapter (the tokens of transformers + peft, merged); a
    directory without an adapter is one line and exit 2."""
    from lora.peft_adapters import merged_greedy, write_adapter
    ckpt = hf_checkpoints["gqa"]
    adapter = write_adapter(ckpt, tmp_path / "a", r=32, seed=3)       # above the default rank
    r = kvslim("generate", "--model", str(ckpt), "--prompt", "In the beginning", "--raw",
               "--max-tokens", "6", "--json", "--kv-cache-memory", "4MiB", "--lora", str(adapter))
    assert r.returncode == 0, r.stderr
    from kvslim.tokenizer.tokenizer import Tokenizer
    prompt = Tokenizer.from_dir(ckpt).encode("In the beginning")
    ours = json.loads(r.stdout)["token_ids"]           # up to 6 tokens: EOS may end it sooner
    assert ours and ours == merged_greedy(ckpt, adapter, [prompt], 6)[0][:len(ours)]
    bad = kvslim("generate", "--model", str(ckpt), "--prompt", "x", "--lora", str(tmp_path))
    assert bad.returncode == 2 and "no adapter_config.json" in bad.stderr
    assert "Traceback" not in bad.stderr and bad.stderr.strip().count("\n") == 0
