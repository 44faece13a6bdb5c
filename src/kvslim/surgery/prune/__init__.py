"""Pruning: zero a fraction of every decoder linear's weights (`masks.py`: which, by magnitude
or Wanda's |W| x input norm; `sparsegpt.py`: SparseGPT's one-shot pruning with weight updates,
optionally quantizing the kept weights jointly) and the whole model, layer by layer
(`model.py`, `kvslim prune`)."""
