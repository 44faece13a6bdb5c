"""llama.cpp's command-line tools as a peer: a clear reason when they are absent, and (where they
are built: KVSLIM_LLAMACPP_BIN or the repo's .cache) perplexity on exactly kvslim's windows."""
import os
from pathlib import Path

import pytest

from kvslim.errors import KvslimError
from kvslim_lab.bench.llamacpp_tools import DEFAULT_BIN, LlamaCppTools

REPO = Path(__file__).resolve().parents[2]


def test_missing_tools_name_what_and_how(tmp_path):
    (tmp_path / "llama-bench").write_text("")
    reason = LlamaCppTools(tmp_path, 1).missing()
    assert reason == (f"llama.cpp tools not found in {tmp_path} (llama-quantize, "
                      "llama-batched-bench, llama-perplexity); build them with "
                      "`bash benchmarks/build_llamacpp.sh`")


def test_perplexity_needs_a_stride_below_the_window(tmp_path):
    with pytest.raises(KvslimError, match="0 < stride < context"):
        LlamaCppTools(tmp_path, 1).perplexity(tmp_path / "m.gguf", tmp_path / "t.txt", 256, 256, 4)


def test_llamacpp_perplexity_is_kvslims_on_the_same_windows(tmp_path, shared_dir):
    tools = LlamaCppTools(Path(os.environ.get("KVSLIM_LLAMACPP_BIN", REPO / DEFAULT_BIN)), 1)
    if tools.missing():
        pytest.skip(tools.missing())
    from kvslim.eval.perplexity import file_perplexity
    from kvslim.formats.gguf.exporter import export_gguf
    model, text = REPO / "models" / "ref-mha", shared_dir / "corpus" / "test.txt"
    gguf = export_gguf(model, tmp_path / "ref.gguf", "f32", show_progress=False)
    ppl, file_tokens = tools.perplexity(gguf, text, 256, 255, 3)    # 3 windows, stride 255
    ours = file_perplexity(model, text, 256, 255, 256 + 2 * 255, show_progress=False)
    assert ours.num_tokens == 3 * 255
    assert ppl == pytest.approx(ours.perplexity, rel=2e-4)    # llama.cpp prints 4 decimals
    assert file_tokens > 100_000
    with pytest.raises(KvslimError, match="ran 256-token windows, not 64"):
        tools.perplexity(gguf, text, 64, 63, 2)           # its context is a multiple of 256
