"""Token embeddings kept in a GGUF file's block form (SmolLM2's Q8_0 `token_embd`), and the LM
head tied to them.

The lookup dequantizes only the rows it gathers (exact, formats/gguf/blocks.py), so the table
stays 1 byte per weight plus its group scales and offsets: for SmolLM2-135M 28 MB + 14 MB
instead of 113 MB of float32. The tied head multiplies with the whole table through the kernel a
BlockQuantLinear of the table's type would run: kvslim's group kernel on the table's own bytes
(float32 activations and sums); without the extension, for an 8-bit table (Q8_0) the exact
float32 one (int8_group_kernel.py says why bfloat16 is not good enough for logits), 113 MB built
by `prepare_for_inference`, for a 4-bit table the int4 kernel."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from kvslim.quantization.base import QuantLinear, QuantSpec
from kvslim.quantization.gguf_blocks import GROUP, _dense_forward, block_kernel, dequantize_groups


class BlockQuantEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        groups = embedding_dim // GROUP
        self.register_buffer("qvalues", torch.zeros(num_embeddings, embedding_dim,
                                                    dtype=torch.uint8))
        self.register_buffer("scales", torch.zeros(num_embeddings, groups))
        self.register_buffer("mins", torch.zeros(num_embeddings, groups))
        self.register_buffer("qtype", torch.zeros(1, dtype=torch.int32))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        rows = dequantize_groups(self.qvalues[ids], self.scales[ids], self.mins[ids])
        return rows.view(*input_ids.shape, self.embedding_dim)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_groups(self.qvalues, self.scales, self.mins)


class TiedBlockQuantHead(QuantLinear):
    """hidden -> logits over the quantized embedding table. Holds no tensors of its own (the
    embedding module owns them; it is kept out of this module's state on purpose, so the
    checkpoint has the table once)."""
    LEAVES = ()

    def __init__(self, embedding: BlockQuantEmbedding, spec: QuantSpec):
        super().__init__(embedding.embedding_dim, embedding.num_embeddings, False, spec)
        self._embedding = (embedding,)            # a tuple: not a registered submodule

    def dequantized_weight(self) -> torch.Tensor:
        return self._embedding[0].dequantized_weight()

    @torch.no_grad()
    def prepare_for_inference(self) -> None:
        """The kernel a one-shard BlockQuantLinear over the table would choose."""
        emb = self._embedding[0]
        if emb.qvalues.device.type != "cpu":
            self.kernel = partial(_dense_forward, weight=emb.dequantized_weight(), bias=None)
            return
        self.kernel = block_kernel(emb.qvalues, emb.scales, emb.mins, emb.qtype.tolist(),
                                   [self.out_features], None)

    def checkpoint_views(self) -> dict:
        return {}
