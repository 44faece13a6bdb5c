"""`LLM`: the offline API. `generate` runs a list of prompts as one continuous batch; `chat`
applies the model's chat template; `stream` yields one request's text as it is generated;
`embed` returns the prompts' embeddings."""
from __future__ import annotations

from collections.abc import Iterator, Sequence as Seq

from tqdm import tqdm

from kvslim.engine.config import EngineConfig
from kvslim.engine.llm_engine import LLMEngine
from kvslim.engine.outputs import KVCacheStats, RequestOutput
from kvslim.engine.sampling_params import SamplingParams
from kvslim.errors import KvslimError

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **options):
        """`model`: an HF-format directory (taken as is), a .gguf file, "gemma3-270m", or
        nothing for the embedded default model. A GGUF model runs what `kvslim generate` runs:
        with dtype="auto" (the default) its quantized blocks, the precision the file ships
        in; dtype="float32" (any explicit dtype) its float32 import
        (formats/registry.py's `engine_model_dir`).
        `options`: EngineConfig's fields (engine/config.py), e.g. kv_cache_memory="2GiB";
        an unknown one is an error that names the close matches.
        tensor_parallel_size > 1 starts that many ranks (`engine/parallel_executor.py`):
        call `shutdown` (or use the LLM as a context manager) to stop them; they also stop at
        interpreter exit. Under torchrun, LLM() on ranks > 0 never returns (SystemExit(0)
        once rank 0 shuts down)."""
        from kvslim.formats.registry import engine_model_dir
        config = EngineConfig.from_options(**options)
        self.model_dir = engine_model_dir(model, config.dtype)
        self.engine = LLMEngine(self.model_dir, config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A prompt is text or a list of token ids; `params`
        is one SamplingParams for all or one per prompt; `lora_request` (enable_lora) one
        LoRARequest for all, or one per prompt (None: the base model)."""
        prompts = _prompt_list(prompts)
        params_list = _per_prompt(params, len(prompts))
        loras = _per_prompt_lora(lora_request, len(prompts))
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params_list, loras):
                ids.append(self.engine.add_request(prompt, p, lora_request=lora))
        except Exception:
            for request_id in ids:                       # leave nothing half-added behind
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, conversations: list[dict] | list[list[dict]],
             params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, tools: list[dict] | None = None,
             tool_choice: str | dict | None = None,
             parallel_tool_calls: bool = True,
             tool_call_parser: str = "auto",
             reasoning_parser: str | None = None, lora_request=None) -> list[RequestOutput]:
        """`tools` (OpenAI's format) are laid out as the server lays them out
        (tools/chat.py), in the format `tool_call_parser` names (as `kvslim serve
        --tool-call-parser`); tool_choice "required" or a named function forces calls; each
        completion's `tool_calls` holds the calls parsed from its text. `reasoning_parser` (as
        `kvslim serve --reasoning-parser`): an output constraint binds the answer after the
        thinking; the text keeps both."""
        from dataclasses import replace
        from kvslim.tools.chat import ToolRequest, encode_chat_with_tools
        from kvslim.tools.registry import reasoning_format, tool_format
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        request = ToolRequest.of(tools, tool_choice, parallel_tool_calls,
                                 tool_format(tool_call_parser, self.tokenizer.chat_template))
        prompts = [encode_chat_with_tools(self.tokenizer, c, request) for c in conversations]
        params = _per_prompt(params, len(prompts))
        forcing = request.forcing()
        if forcing is not None:
            params = [replace(p, structured_outputs=forcing) for p in params]
        if request.keeps_special_tokens:
            params = [replace(p, skip_special_tokens=False) for p in params]
        reasoning = reasoning_format(reasoning_parser)
        if reasoning is not None:
            params = [replace(p, structured_outputs=replace(p.structured_outputs,
                                                            reasoning=reasoning))
                      if p.structured_outputs is not None else p for p in params]
        outputs = self.generate(prompts, params, use_tqdm, lora_request)
        if request.parses_calls:
            for out in outputs:
                for c in out.outputs:
                    c.tool_calls = request.parse(c.text)[1]
        return outputs

    def beam_search(self, prompts: Prompt | Seq[Prompt], beam_width: int, max_tokens: int,
                    n: int | None = None, length_penalty: float = 1.0,
                    early_stopping: bool | str = False, ignore_eos: bool = False,
                    use_tqdm: bool = True) -> list[RequestOutput]:
        """Beam search of `beam_width` beams per prompt (engine/beam_search.py); each output
        holds the `n` (default: beam_width) best hypotheses, best first."""
        params = SamplingParams(use_beam_search=True, n=n or beam_width, best_of=beam_width,
                                max_tokens=max_tokens, temperature=0.0,
                                length_penalty=length_penalty, early_stopping=early_stopping,
                                ignore_eos=ignore_eos)
        return self.generate(prompts, params, use_tqdm)

    def embed(self, prompts: Prompt | Seq[Prompt], pooling: str = "last") -> list[list[float]]:
        """One L2-normalised embedding per prompt, in order: the final normed hidden state of
        its last token ("last") or their mean ("mean"), what `kvslim serve`'s /v1/embeddings
        returns (engine/embedding.py)."""
        return [out.embedding for out in self.engine.embed(_prompt_list(prompts), pooling)]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               lora_request=None) -> Iterator[str]:
        """Text deltas of one request as they are produced (other requests may run alongside)."""
        request_id = self.engine.add_request(prompt, params, lora_request=lora_request)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        if out.error:
                            raise KvslimError(out.error)
                        if out.outputs[0].delta_text:
                            yield out.outputs[0].delta_text
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(request_id)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", unit="req", disable=not use_tqdm)
        try:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        bar.update(1)
                bar.set_postfix(running=self.engine.num_running, waiting=self.engine.num_waiting)
        finally:
            bar.close()
            for request_id in pending:                   # interrupted: free their blocks
                self.engine.abort_request(request_id)
        return [results[r] for r in request_ids]

    def kv_cache_stats(self) -> KVCacheStats:
        return self.engine.kv_cache_stats()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel ranks, if any (idempotent)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """One prompt (text, or a list of token ids) or several, as a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                    and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def _per_prompt_lora(lora_request, n: int) -> list:
    if lora_request is None or not isinstance(lora_request, (list, tuple)):
        return [lora_request] * n
    if len(lora_request) != n:
        raise ValueError(f"got {len(lora_request)} LoRA requests for {n} prompts")
    return list(lora_request)
