"""Run by the python of vLLM's own venv (never imported there with kvslim): loads one model
with `vllm.LLM` and answers the requests of `vllm_peer.py`, one JSON object a line on stdin,
each reply a line on stdout after REPLY (vLLM's own logs go to stderr). Imports nothing from
kvslim, so that it runs beside vLLM's torch.

    python vllm_worker.py '{"model": DIR, "dtype": "bfloat16", "max_model_len": 512, ...}'

Requests: {"op": "decode", "prompt": [ids], "output_len": n} -> {"tpot_s": s};
{"op": "offline", "prompts": [[ids], ...], "output_len": n} -> {"seconds": s};
{"op": "quit"}."""
import json
import os
import sys
import time

REPLY = "@kvslim-peers "


REPLIES = sys.stdout


def reply(obj) -> None:
    REPLIES.write(REPLY + json.dumps(obj) + "\n")
    REPLIES.flush()


def logs_to_stderr() -> None:
    """Keep stdout for the replies and send everything else written to it (vLLM's logs, its
    C++ warnings) to stderr, which the client keeps as the log."""
    global REPLIES
    REPLIES = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)


def generate(llm, prompts, output_len: int) -> float:
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0.0,
                            ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return seconds


def serve(llm) -> None:
    warm = set()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            return
        try:
            if req["op"] not in warm:            # the first request's own shapes, once
                warm.add(req["op"])
                generate(llm, req.get("prompts", [req.get("prompt")])[:2], 2)
            if req["op"] == "decode":
                first = generate(llm, [req["prompt"]], 1)
                total = generate(llm, [req["prompt"]], req["output_len"])
                reply({"tpot_s": (total - first) / max(1, req["output_len"] - 1)})
            else:
                reply({"seconds": generate(llm, req["prompts"], req["output_len"])})
        except Exception as e:                       # the client reports it as the reason
            reply({"error": f"{type(e).__name__}: {e}"})


def main() -> None:
    # Run as a script, its folder (kvslim's peer modules) comes first on the path: not vLLM's.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = json.loads(sys.argv[1])
    logs_to_stderr()
    try:
        import vllm
        llm = vllm.LLM(model=spec["model"], dtype=spec["dtype"], skip_tokenizer_init=True,
                       max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"],
                       enforce_eager=spec.get("enforce_eager", False), seed=0)
        generate(llm, [[1, 2, 3, 4]], 4)                                       # warm-up
    except Exception as e:
        reply({"error": f"{type(e).__name__}: {e}"})
        return
    reply({"ready": vllm.__version__})
    serve(llm)


if __name__ == "__main__":
    main()
