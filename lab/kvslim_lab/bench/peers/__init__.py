"""`kvslim bench peers`: kvslim beside its peers at their best, in one run — llama.cpp's own tools
on its own quantizations, vLLM's CPU build, HF transformers at its best batch — on the embedded
default model and the same token ids, the engines taking turns in every round so that the
ratios come from one run. `catalog.py` names the engines and builds them, `suite.py` runs the
rounds and holds the result, `local.py` (kvslim, HF: in this process), `llamacpp.py` and
`vllm_peer.py` (subprocesses; `vllm_worker.py` runs inside vLLM's own venv) are the engines,
`render.py` writes the markdown table and the plot."""
