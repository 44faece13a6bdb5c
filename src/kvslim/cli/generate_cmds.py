"""`kvslim generate` (one prompt, streamed) and `kvslim chat` (interactive)."""
from __future__ import annotations

import json
import sys
import time

from kvslim.cli.engine_args import (add_engine_args, add_sampling_args, llm_from_args,
                                    sampling_from_args)

MODEL_HELP = "model directory, .gguf file or 'default' (the embedded SmolLM2-135M-Instruct)"
LORA_HELP = "answer with this peft LoRA adapter directory (turns --enable-lora on)"


def register(sub) -> None:
    p = sub.add_parser("generate", help="answer one prompt")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true",
                   help="complete the text as is (default: use the model's chat template "
                        "when it has one)")
    p.add_argument("--system", help="system message (chat template only)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--lora", metavar="DIR", help=LORA_HELP)
    add_sampling_args(p)
    add_engine_args(p, kv_cache_memory="256MiB", max_num_seqs=8)
    p.set_defaults(func=run_generate)

    p = sub.add_parser("chat", help="interactive chat with streamed answers")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--system", help="system message")
    p.add_argument("--lora", metavar="DIR", help=LORA_HELP)
    add_sampling_args(p, max_tokens=512)
    add_engine_args(p, kv_cache_memory="256MiB", max_num_seqs=8)
    p.set_defaults(func=run_chat)


def build_prompt(llm, text: str, raw: bool, system: str | None):
    if raw or not llm.tokenizer.chat_template:
        return text
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": text}]
    return llm.tokenizer.encode_chat(messages)


def lora_from_args(args):
    """--lora DIR: its LoRARequest, the engine's LoRA options raised to take it; or None."""
    if not args.lora:
        return None
    from kvslim.lora.adapter import read_config
    from kvslim.lora.request import LoRARequest
    lora = LoRARequest("lora", 1, args.lora)
    config = read_config(lora)                  # a missing or refused adapter: one line
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    args.enable_lora, args.max_lora_rank = True, max(args.max_lora_rank, *ranks)
    return lora


def run_generate(args) -> int:
    lora = lora_from_args(args)
    with llm_from_args(args) as llm:             # stops tensor-parallel ranks at the end
        return _generate(llm, args, lora)


def _generate(llm, args, lora=None) -> int:
    params = sampling_from_args(args)
    prompt = build_prompt(llm, args.prompt, args.raw, args.system)
    if args.json:
        out = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0]
        c, m = out.outputs[0], out.metrics
        print(json.dumps({
            "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
            "prompt_tokens": m.num_prompt_tokens, "completion_tokens": m.num_output_tokens,
            "time_to_first_token_s": m.time_to_first_token,
            "time_per_output_token_s": m.time_per_output_token}, indent=2))
        return 0
    for delta in llm.stream(prompt, params, lora_request=lora):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def run_chat(args) -> int:
    lora = lora_from_args(args)
    llm = llm_from_args(args)
    if not llm.tokenizer.chat_template:
        print("kvslim chat: error: this model has no chat template; use kvslim generate --raw",
              file=sys.stderr)
        return 2
    params = sampling_from_args(args)
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    print("kvslim chat — /reset clears the conversation, /exit or Ctrl-D quits.")
    while True:
        try:
            line = input("\n> ").strip()
        except EOFError:
            print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = list(base)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        start, reply = time.perf_counter(), []
        for delta in llm.stream(llm.tokenizer.encode_chat(history), params, lora_request=lora):
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        history.append({"role": "assistant", "content": "".join(reply)})
        print(f"\n[{time.perf_counter() - start:.1f}s]")
