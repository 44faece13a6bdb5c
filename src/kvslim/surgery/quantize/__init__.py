"""Weight-only quantization into the GPTQ checkpoint layout: round to nearest (`rtn.py`), GPTQ
(`gptq.py`), and the whole model, layer by layer (`model.py`)."""
