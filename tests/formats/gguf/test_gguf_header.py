"""FastGGUFReader reads the same metadata and tensors as gguf-py's own GGUFReader: every key's
value equal to `ReaderField.contents()`, every tensor's name, type, shape, offset and bytes, on
tiny files of each vocabulary and tensor type and on SmolLM2's real file; a cut file is a
readable error."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from gguf_files import write_tiny_gguf
from kvslim.errors import ConfigError
from kvslim.formats.gguf.file import GGUFFile
from kvslim.formats.gguf.header import FastGGUFReader


def assert_same(path):
    stock, fast = GGUFReader(path), FastGGUFReader(path)
    keys = [k for k in stock.fields if not k.startswith("GGUF.")]
    assert list(fast.values) == keys
    for key in keys:
        assert fast.values[key] == stock.fields[key].contents(), key
    assert fast.data_offset == stock.data_offset and fast.alignment == stock.alignment
    assert len(fast.tensors) == len(stock.tensors) > 0
    for a, b in zip(fast.tensors, stock.tensors):
        assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
    return fast


@pytest.mark.parametrize("kwargs", [
    dict(), dict(vocab="llama"), dict(qtype=Q.Q8_0, tied=True),
    dict(types={"attn_q": Q.Q4_K, "attn_v": Q.Q6_K, "token_embd": Q.Q8_0}, hidden=256, ffn=256),
])
def test_tiny_files_read_alike(tmp_path, kwargs):
    write_tiny_gguf(tmp_path / "m.gguf", **kwargs)
    fast = assert_same(tmp_path / "m.gguf")
    assert isinstance(fast.values["tokenizer.ggml.tokens"][0], str)


def test_smollm2_reads_alike(smollm2_gguf):
    fast = assert_same(smollm2_gguf)
    assert len(fast.values["tokenizer.ggml.tokens"]) == 49152
    assert fast.values["general.architecture"] == "llama"


def test_a_cut_file_is_a_readable_error(tmp_path):
    write_tiny_gguf(tmp_path / "m.gguf")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:200])
    with pytest.raises(ConfigError, match="cut.gguf is not a readable GGUF file"):
        GGUFFile.open(tmp_path / "cut.gguf")
