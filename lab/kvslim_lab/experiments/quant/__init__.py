"""`kvslim experiment quant`, every quantization mode beside its peers: `arms.py` the table of
arms (how each model is built, what is measured on it), `measure.py` each measurement (with
`engine_ppl.py`, perplexity through the engine's KV cache, and bench/llamacpp_tools.py,
llama.cpp's own tools as a peer), `study.py` builds and records them, `goals.py` checks the goals,
`report.py` writes docs/quantization.md."""
