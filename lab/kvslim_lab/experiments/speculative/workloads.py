"""The speculative study's two workloads and their prompts: free generation, and an
input-grounded one (rewriting or continuing a given passage, editing code) where a continuation
can copy from its input."""
from __future__ import annotations

import random

from kvslim_lab.experiments.speculative.records import Target

WORKLOADS = ("free", "grounded")

QUESTIONS = [
    "What is the capital of France?", "Explain what a hash table is.",
    "Give three tips for writing clear emails.", "Why is the sky blue?",
    "How do vaccines work?", "Write a short poem about autumn.",
    "What causes the seasons on Earth?", "Describe how a bicycle works.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet.", "How does a refrigerator keep food cold?",
    "What are the benefits of regular exercise?", "Explain recursion to a beginner.",
    "What is photosynthesis?", "How do I make a cup of tea?", "What is a black hole?",
]

CODE = [
    "def total(xs):\n    s = 0\n    for x in xs:\n        s = s + x\n    return s\n\n"
    "def mean(xs):\n    return total(xs) / len(xs)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n",
    "def read_lines(path):\n    with open(path) as f:\n        lines = f.readlines()\n"
    "    return [line.strip() for line in lines if line.strip()]\n",
]


def workload_prompts(target: Target, tokenizer, workload: str, text: str, n: int,
                     passage_tokens: int, seed: int) -> list:
    """Prompts (text or token ids) for one workload: free generation (questions for a chat
    model, passage openings for a base model) or input-grounded (rewrite a passage or edit
    code for a chat model; continue a passage it has just read for a base model)."""
    rng = random.Random(seed)
    ids = tokenizer.encode(text)
    starts = [rng.randrange(0, len(ids) - 2 * passage_tokens) for _ in range(n)]
    passages = [tokenizer.decode(ids[s:s + passage_tokens]) for s in starts]
    if target.chat:
        if workload == "free":
            messages = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
        else:
            messages = [f"Rename the function or class in this code to a clearer name and "
                        f"give the whole code back:\n\n{CODE[i % len(CODE)]}" if i % 2 else
                        f"Rewrite this passage in modern English, keeping every sentence:\n\n"
                        f"{passages[i]}" for i in range(n)]
        return [tokenizer.encode_chat([{"role": "user", "content": m}]) for m in messages]
    if workload == "free":
        return [ids[s:s + 32] for s in starts]
    # The passage, a blank line, then its first words again: a continuation can copy it.
    return [ids[s:s + passage_tokens] + tokenizer.encode("\n\n") + ids[s:s + 12]
            for s in starts]
