"""`kvslim experiment prune`: magnitude, Wanda and SparseGPT at every sparsity, with and without
4-bit kept weights, and recovery uptraining -> docs/pruning.md."""
