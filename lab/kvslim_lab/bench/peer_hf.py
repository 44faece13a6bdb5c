"""HF transformers as a peer: `generate` on static, left-padded batches — how its users batch."""
from __future__ import annotations

import time

import torch


class HFPeer:
    name = "hf"

    def __init__(self, model_dir, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        from transformers import AutoModelForCausalLM
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(
            self.device).eval()
        self.label = f"HF transformers {__import__('transformers').__version__}"

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], output_len: int, batch_size: int) -> float:
        """Seconds to generate exactly `output_len` tokens for every prompt, greedy."""
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, p in enumerate(batch):
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_new_tokens=output_len, min_new_tokens=output_len,
                                      do_sample=False, pad_token_id=0)
            assert out.shape[1] == width + output_len
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def latency(self, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
        """(time to first token, time per output token) for one batch of prompts: the first
        token timed by generating one token, the rest from a full run."""
        ttft = self.generate(prompts, 1, len(prompts))
        total = self.generate(prompts, output_len, len(prompts))
        return ttft, (total - ttft) / max(1, output_len - 1)
