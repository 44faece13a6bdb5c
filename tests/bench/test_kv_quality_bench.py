"""`kvslim bench kv-quality` on a tiny random model: the float cache read back through chunked
prefill scores what the dense pass scores, a setting the engine does not take is a row of the
table (not an error), a passkey context beyond the model's is skipped with its reason, and the
JSON, markdown and PNG are written."""
import json
import math

import pytest

from checkpoints import TOKENIZER_TEXT, write_checkpoint
from kvslim.errors import KvslimError
from kvslim_lab.bench.kv_quality import KVQualityConfig, parse_settings, run_kv_quality
from kvslim_lab.bench.kv_quality_report import format_markdown, write_report


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvq")
    (root / "text.txt").write_text(TOKENIZER_TEXT)
    return write_checkpoint("gqa", root / "gqa"), root / "text.txt"


def test_settings_parse_into_engine_options():
    s = parse_settings(["float,int8,int4+rot,w=1024,s=4", "bf16", "fp8"])
    assert [x.name for x in s] == ["float", "int8", "int4+rot,w=1024,s=4", "bf16", "fp8"]
    assert s[0].options == {"kv_cache_dtype": "auto"}
    assert s[2].options == {"kv_cache_dtype": "int4", "kv_hadamard": True, "kv_window": 1024,
                            "kv_sink_tokens": 4}
    assert s[3].options["kv_cache_dtype"] == "bfloat16"
    assert s[4].options["kv_cache_dtype"] == "fp8_e4m3"
    for bad in (["w=8"], ["int4,x=3"], ["int4,w=big"], [""]):
        with pytest.raises(KvslimError):
            parse_settings(bad)


def test_float_and_an_unsupported_setting(tiny, tmp_path):
    model, text = tiny
    cfg = KVQualityConfig(models=[str(model)], settings=parse_settings(["float,int3"]),
                          kv_cache_memory="4MiB", context=256, data=str(text), max_tokens=160,
                          window=64, chunk=16, passkey_contexts=(32, 384, 1024),
                          passkey_depths=(0.5,), passkey_tokens=4, speed_batches=(1, 2),
                          speed_tokens=4)
    result = run_kv_quality(cfg, show_progress=False)
    (m,) = result.models
    flt, unsupported = m.settings
    assert flt.error is None and flt.kv_bytes_per_token > 0 and flt.sequences >= 1
    # 64-token windows prefilled 16 at a time: each chunk reads the earlier ones from the cache
    assert math.isclose(flt.perplexity, m.dense_perplexity, rel_tol=1e-3)
    assert flt.ppl_tokens == 63 + 63 + 31 and flt.vs_float_pct == 0.0
    short, ok, beyond = flt.passkey
    assert short.cases == 0 and "too few" in short.skipped
    assert (ok.cases, ok.skipped) == (1, None)
    assert beyond.cases == 0 and "512 positions" in beyond.skipped
    assert set(flt.decode_tok_s) == {"1", "2"} and all(v > 0 for v in flt.decode_tok_s.values())
    assert unsupported.error.startswith("not supported: ") and unsupported.perplexity is None

    paths = write_report(result, tmp_path / "out")
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)
    d = json.loads(paths[0].read_text())
    rows = d["models"][0]["settings"]
    assert [r["setting"] for r in rows] == ["float", "int3"]
    assert rows[1]["error"].startswith("not supported")
    md = format_markdown(result)
    assert "| passkey 32 | passkey 384 | passkey 1024 | tok/s b=1 | tok/s b=2 |" in md
    assert "| `int3` | not supported: " in md and "skipped" in md
