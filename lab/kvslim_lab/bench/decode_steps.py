"""`full_batch_steps`: the seconds of each engine step in which a whole batch decodes (no
prefill in the step), the measure `kvslim bench structured` and `kvslim bench lora` compare."""
from __future__ import annotations

import time

from kvslim.engine.llm import LLM
from kvslim.engine.sampling_params import SamplingParams


def full_batch_steps(llm: LLM, prompts, params: list[SamplingParams],
                     loras: list | None = None) -> list[float]:
    """Run `prompts` (each with its params, and its LoRARequest if given) to the end."""
    engine = llm.engine
    for prompt, p, lora in zip(prompts, params, loras or [None] * len(prompts)):
        engine.add_request(prompt, p, lora_request=lora)
    times = []
    while engine.has_unfinished_requests():
        decoding = engine.num_running == len(prompts) and not engine.num_waiting and all(
            s.num_uncomputed_tokens == 1 for s in engine.scheduler.running)
        start = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
    return times
