"""Prompts to train a drafter on (kvslim train-drafter --prompts): for a chat model, templates
over topics, none of them the free-generation questions the speculative study measures with
(experiments/speculative/workloads.py), so a drafter is measured on prompts it never saw; for a
base model (`--passages TEXT`), passages of ~300 characters from random places of a training
text (the study's base-model prompts come from the test text).

    python benchmarks/drafter_prompts.py OUT.txt [--n 480] [--passages TEXT --seed 0]
"""
from __future__ import annotations

import argparse
import itertools
import random

from kvslim_lab.experiments.speculative.workloads import QUESTIONS

TEMPLATES = ["Explain {t} in simple terms.", "What is {t}?", "Give three facts about {t}.",
             "How does {t} work?", "Write a short paragraph about {t}.",
             "What are the advantages and disadvantages of {t}?",
             "Why is {t} important?", "Describe the history of {t} briefly."]
TOPICS = ["the moon", "electricity", "a computer", "the ocean", "a volcano", "money", "music",
          "the internet", "a rainbow", "gravity", "the heart", "a library", "coffee", "bees",
          "the Roman Empire", "democracy", "a camera", "solar panels", "chess", "a compiler",
          "sleep", "friendship", "the weather", "a bridge", "trains", "bread", "the brain",
          "a garden", "mountains", "recycling", "a telescope", "the alphabet", "rivers",
          "an airplane", "soap", "a clock", "the stock market", "email", "a museum",
          "cooking pasta", "learning a language", "a database", "encryption", "the printing "
          "press", "penguins", "a battery", "earthquakes", "a hospital", "the Olympic Games",
          "a violin", "vitamins", "a spreadsheet", "deserts", "the immune system", "a city",
          "sorting algorithms", "the water cycle", "a newspaper", "glass", "dinosaurs"]


def prompts(n: int, seed: int = 0) -> list[str]:
    every = [t.format(t=topic) for t, topic in itertools.product(TEMPLATES, TOPICS)]
    every = [p for p in every if p not in QUESTIONS]
    random.Random(seed).shuffle(every)
    return every[:n]


def passages(path: str, n: int, seed: int = 0, chars: int = 300) -> list[str]:
    """n passages of about `chars` characters, whitespace collapsed, cut at word boundaries."""
    text = open(path, encoding="utf-8").read()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(text) - 4 * chars)
        words = " ".join(text[start:start + 2 * chars].split()).split(" ")[1:]   # whole words
        line = ""
        while words and len(line) + len(words[0]) + 1 <= chars:
            line = f"{line} {words.pop(0)}".strip()
        out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=480)
    ap.add_argument("--passages", default=None, help="a text to take base-model prompts from")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lines = (passages(args.passages, args.n, args.seed) if args.passages
             else prompts(args.n, args.seed))
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} prompts to {args.out}")


if __name__ == "__main__":
    main()
