"""Llama-family MHA/GQA → DeepSeek-V2 multi-head latent attention (`kvslim convert --to-mla`).

One representation serves both methods (docs/mla-conversion.md has the derivation):
`options.py` checks a request against the source before anything is loaded or written;
`frequencies.py` decides which RoPE frequency pairs keep their rotation (and, for TransMLA, how the
KV heads are mixed per frequency first) and writes the RoPE config that rotates them;
`factorize.py` builds one layer's DeepSeek tensors: queries, the shared RoPE key, and the joint
low-rank latent of the un-rotated keys and the values; `convert.py` runs it over a model and
writes the checkpoint."""
