"""Chat prompts to train a drafter on (kvslim train-drafter --prompts): templates over topics,
none of them the free-generation questions the speculative study measures with
(experiments/speculative/workloads.py), so a drafter is measured on prompts it never saw.

    python benchmarks/drafter_prompts.py OUT.txt [--n 480]
"""
from __future__ import annotations

import argparse
import itertools
import random

from kvslim.experiments.speculative.workloads import QUESTIONS

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=480)
    args = ap.parse_args()
    lines = prompts(args.n)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} prompts to {args.out}")


if __name__ == "__main__":
    main()
