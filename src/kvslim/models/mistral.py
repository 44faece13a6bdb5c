"""Mistral: the Llama decoder (models/llama.py), every layer with the config's sliding window.
llama.cpp stores it as a `llama` file, which has no key for the window (llama.cpp runs such a
model with full attention, as its own converter writes it); such a file imports as Llama."""
from __future__ import annotations

from dataclasses import replace

from kvslim.models import llama
from kvslim.models.base import Family

FAMILY = Family("mistral", "MistralForCausalLM", "Mistral", llama.LlamaForCausalLM,
                gguf=replace(llama.GGUF, imports=False), converts_to_mla=True)
