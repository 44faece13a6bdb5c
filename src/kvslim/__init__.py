"""kvslim: an LLM inference toolkit for when the KV cache, not the weights, is the wall."""
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "LoRARequest", "LLMEngine",
           "EngineConfig", "__version__"]


def __getattr__(name):
    # Lazy, so that `import kvslim` (and the CLI's start) does not pay for torch.
    if name == "LLM":
        from kvslim.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from kvslim.engine.sampling_params import SamplingParams
        return SamplingParams
    if name == "StructuredOutputsParams":
        from kvslim.structured.params import StructuredOutputsParams
        return StructuredOutputsParams
    if name == "LoRARequest":
        from kvslim.lora.request import LoRARequest
        return LoRARequest
    if name == "LLMEngine":
        from kvslim.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "EngineConfig":
        from kvslim.engine.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
