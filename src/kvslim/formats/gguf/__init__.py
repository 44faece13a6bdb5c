"""GGUF files (llama.cpp's format) in and out: `file.py` opens one (`header.py`: its metadata in
one pass), `importer.py` turns it into an HF-format directory and `exporter.py` writes one back,
`tokenizer.py` rebuilds or writes its vocabulary; `archs.py` holds the architectures' tensor
tables, `moe.py` the experts' keys and stacked tensors, `rope.py` Llama 3.1's RoPE divisors;
`weights.py` and `blocks.py` read quantized tensors as their blocks."""
