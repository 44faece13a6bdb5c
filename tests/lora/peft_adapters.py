"""peft adapters on the test checkpoints, and transformers' merged model as their reference."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(checkpoint: Path, path: Path, r: int = 8, alpha: int = 16,
                  targets: list[str] = ALL, seed: int = 0, **extra) -> Path:
    """A LoRA adapter with random A and B (peft leaves B zero: a no-op adapter) whose product
    moves the model's greedy tokens, saved by peft's own save_pretrained."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                            lora_dropout=0.0, **extra))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.15)
    peft.save_pretrained(path)
    return path


def merged_greedy(checkpoint: Path, adapter: Path | None, prompts: list[list[int]],
                  max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens, with the adapter merged into the weights by peft."""
    from engine.engine_helpers import hf_greedy
    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return hf_greedy(model, prompts, max_new_tokens)
