"""`kvslim demo`: sixteen chat requests, several sharing a long system prompt, served as one
continuous batch; ends with what the engine measured."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from kvslim.engine.sampling_params import SamplingParams

SYSTEM = (
    "You are the help desk of a small public library. Answer in two or three short, friendly "
    "sentences. The library is open Monday to Friday from 9 am to 7 pm and on Saturday from "
    "10 am to 4 pm; it is closed on Sunday and public holidays. Members may borrow up to ten "
    "books for three weeks and renew them twice online unless another member has reserved "
    "them. Late returns cost twenty cents per book per day. The reading room has free Wi-Fi, "
    "power outlets at every desk and a quiet zone on the first floor. Printing costs ten cents "
    "a page. Children's story time is on Wednesday at 4 pm. If you do not know an answer, say "
    "so and suggest asking a librarian at the front desk.")

LIBRARY_QUESTIONS = [
    "Are you open on Sunday?",
    "How many books can I borrow at once?",
    "What happens if I return a book five days late?",
    "Can I renew a book that someone else reserved?",
    "Is there Wi-Fi in the reading room?",
    "When is story time for kids?",
    "How much does printing cost?",
    "What time do you close on Saturday?",
    "Where can I work quietly?",
    "Can I borrow a book for two months?",
]

GENERAL_QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Give me three tips for a good night's sleep.",
    "Explain what a KV cache is in one sentence.",
    "Write a haiku about autumn.",
    "What is 17 multiplied by 3?",
    "Name three planets of the solar system.",
]


def demo_conversations() -> list[list[dict]]:
    library = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
               for q in LIBRARY_QUESTIONS]
    general = [[{"role": "user", "content": q}] for q in GENERAL_QUESTIONS]
    # Interleave, so that the batch mixes short and long prompts.
    return [c for pair in zip(library, general + [None] * len(library)) for c in pair if c]


@dataclass
class DemoReport:
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    output_tokens_per_s: float
    kv_bytes_per_token: int
    kv_dtype: str
    blocks_total: int
    blocks_peak_used: int
    block_size: int
    peak_concurrent_sequences: int
    prefix_cache_hit_rate: float
    prefix_cache_hit_tokens: int
    mean_time_to_first_token_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def as_plain_prompt(conv: list[dict]) -> str:
    """A conversation as text for a base model without a chat template (Gemma 3 270M): the
    system prompt, then the question and an answer cue."""
    system = conv[0]["content"] + "\n\n" if conv[0]["role"] == "system" else ""
    return f"{system}Question: {conv[-1]['content']}\nAnswer:"


def run_demo(llm, max_tokens: int = 96, use_tqdm: bool = True):
    convs = demo_conversations()
    chat = bool(llm.engine.tokenizer.chat_template)
    # a base model answers, then goes on to ask the next question itself
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                            stop=[] if chat else ["\nQuestion:", "\n\n"])
    start = time.perf_counter()
    if chat:
        outputs = llm.chat(convs, params, use_tqdm=use_tqdm)
    else:
        outputs = llm.generate([as_plain_prompt(c) for c in convs], params, use_tqdm=use_tqdm)
    seconds = time.perf_counter() - start
    engine = llm.engine
    stats = engine.kv_cache_stats()
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = [o.metrics.time_to_first_token for o in outputs]
    report = DemoReport(
        requests=len(outputs), prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        output_tokens=out_tokens, seconds=round(seconds, 2),
        output_tokens_per_s=round(out_tokens / seconds, 1),
        kv_bytes_per_token=stats.bytes_per_token,
        kv_dtype=stats.kv_cache_dtype,
        blocks_total=stats.num_blocks, blocks_peak_used=engine.peak_used_blocks,
        block_size=stats.block_size, peak_concurrent_sequences=engine.peak_num_running,
        prefix_cache_hit_rate=round(stats.prefix_cache_hit_rate, 3),
        prefix_cache_hit_tokens=stats.prefix_cache_hits,
        mean_time_to_first_token_s=round(sum(ttfts) / len(ttfts), 3))
    return convs, outputs, report
