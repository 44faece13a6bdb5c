"""Which grammar library should mask kvslim's logits? llguidance, xgrammar and outlines-core,
measured on the same schemas and tokens: the tokenizer set-up, the compile of each schema, and
the per-step cost of one batch's masks (every matcher fills its bitmask row, then takes its next
token) at batch 1 and 32, on SmolLM2's 49k and Gemma 3's 262k vocabularies.

    python benchmarks/grammar_backends.py [--backends llguidance,xgrammar,outlines_core] \
        [--models smollm2,gemma3] [--batches 1,32] [--threads 2] [--json] [--out FILE]

Each matcher walks the tokens of a valid instance of its schema (the model's own tokenization of
the JSON text), so every step's mask is a real one. A backend that is not installed, or that
fails a schema, is reported with the reason. The libraries are installed beside kvslim for the
probe (`pip install llguidance==1.9.1 xgrammar==0.2.8 outlines-core==0.2.14`); kvslim depends
on the one chosen (docs/structured_outputs.md)."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvslim.formats.registry import default_model_dir, gemma3_dir
from kvslim.tokenizer.tokenizer import Tokenizer

SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}},
        "required": ["name", "age", "email"]},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"}),
    "order": ({"type": "object", "properties": {
        "id": {"type": "string"}, "status": {"enum": ["open", "paid", "shipped"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {"sku": {"type": "string"},
                                             "qty": {"type": "integer"}},
            "required": ["sku", "qty"]}}},
        "required": ["id", "status", "items"]},
        {"id": "A-17", "status": "paid", "items": [{"sku": "kb-1", "qty": 2},
                                                   {"sku": "ms-9", "qty": 1}]}),
    "any_object": ({"type": "object"}, {"answer": "Paris", "confidence": 0.9, "tags": ["geo"]}),
}


def load_tokenizer(model: str) -> Tokenizer:
    directory = default_model_dir(show_progress=False) if model == "smollm2" \
        else gemma3_dir(show_progress=False, quantized=True)
    return Tokenizer.from_dir(directory)


def vocab_size(tok: Tokenizer) -> int:
    return tok.vocab_size


# ---- backends: setup(tok) -> state; compile(state, schema) -> grammar; matcher(grammar);
# ---- fill(matchers, bitmask); accept(matcher, token) ---------------------------------------
class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer, threads: int):
        import llguidance
        import llguidance.torch
        self.llg = llguidance
        self.fill_par = llguidance.torch.fill_next_token_bitmask_par
        self.tokenizer = llguidance.LLTokenizer(tok.tok.to_str(), n_vocab=vocab_size(tok),
                                                eos_token=tok.eos_token_ids)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.vocab = vocab_size(tok)

    def compile(self, schema: dict):
        return self.llg.LLMatcher.grammar_from_json_schema(schema)

    def matcher(self, grammar):
        m = self.llg.LLMatcher(self.tokenizer, grammar)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def bitmask(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, (self.vocab + 31) // 32, dtype=torch.int32)

    def fill(self, matchers, bitmask):
        self.fill_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, threads: int):
        import xgrammar
        from transformers import PreTrainedTokenizerFast
        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_object=tok.tok)
        self.vocab = vocab_size(tok)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab,
                                                       stop_token_ids=tok.eos_token_ids)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads) \
            if hasattr(xgrammar, "BatchGrammarMatcher") else None

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matchers, bitmask):
        if self.batch is not None and len(matchers) > 1:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
            return
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class OutlinesCore:
    name = "outlines_core"

    def __init__(self, tok: Tokenizer, threads: int):
        import outlines_core
        self.oc = outlines_core
        self.vocab = vocab_size(tok)
        eos = tok.eos_token_ids[0]
        tokens: dict[bytes, list[int]] = {}
        for i in range(self.vocab):
            if i in tok.eos_token_ids:
                continue
            piece = tok.tok.decode([i], skip_special_tokens=False).encode("utf-8", "surrogatepass")
            if piece:
                tokens.setdefault(piece, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, grammar):
        return self.oc.Guide(grammar)

    def bitmask(self, batch: int) -> torch.Tensor:
        return torch.zeros(batch, (self.vocab + 31) // 32, dtype=torch.int32)

    def fill(self, matchers, bitmask):
        for i, m in enumerate(matchers):
            row = bitmask[i]
            m.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def accept(self, matcher, token: int) -> bool:
        matcher.advance(token)
        return True


BACKENDS = {b.name: b for b in (LLGuidance, XGrammar, OutlinesCore)}


def walk(backend, grammar, tokens: list[int], batch: int) -> list[float]:
    """Seconds per step for `batch` matchers of one grammar walking `tokens` together."""
    matchers = [backend.matcher(grammar) for _ in range(batch)]
    bitmask = backend.bitmask(batch)
    times = []
    for token in tokens:
        start = time.perf_counter()
        backend.fill(matchers, bitmask)
        for m in matchers:
            if not backend.accept(m, token):
                raise RuntimeError(f"token {token} rejected")
        times.append(time.perf_counter() - start)
        word = int(bitmask[0, token // 32]) & (1 << (token % 32))
        if not word:
            raise RuntimeError(f"token {token} masked out on a valid path")
    return times


def measure(backend_cls, model: str, tok: Tokenizer, batches: list[int], threads: int) -> dict:
    row = {"backend": backend_cls.name, "model": model, "vocab": vocab_size(tok)}
    try:
        start = time.perf_counter()
        backend = backend_cls(tok, threads)
        row["setup_s"] = time.perf_counter() - start
    except Exception as e:                                   # not installed, or no such API
        row["error"] = f"{type(e).__name__}: {e}"
        return row
    row["schemas"] = {}
    for name, (schema, instance) in SCHEMAS.items():
        tokens = tok.encode(json.dumps(instance), add_special_tokens=False)
        entry = {"tokens": len(tokens)}
        try:
            start = time.perf_counter()
            grammar = backend.compile(schema)
            backend.matcher(grammar)
            entry["compile_ms"] = 1e3 * (time.perf_counter() - start)
            for batch in batches:
                steps = walk(backend, grammar, tokens, batch)
                entry[f"step_ms_b{batch}"] = 1e3 * statistics.median(steps)
                entry[f"step_ms_max_b{batch}"] = 1e3 * max(steps)
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["schemas"][name] = entry
    return row


def table(rows: list[dict], batches: list[int]) -> str:
    head = ["backend", "model", "setup s", "schema", "compile ms"] + \
        [f"step ms b={b} (median / max)" for b in batches]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['model']} | - | - | {r['error']} |")
            continue
        for name, e in r["schemas"].items():
            cells = [r["backend"], r["model"], f"{r['setup_s']:.2f}", name]
            if "error" in e:
                cells += [e["error"]]
            else:
                cells += [f"{e['compile_ms']:.1f}"] + [
                    f"{e[f'step_ms_b{b}']:.3f} / {e[f'step_ms_max_b{b}']:.2f}" for b in batches]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for model in args.models.split(","):
        tok = load_tokenizer(model)
        for name in args.backends.split(","):
            rows.append(measure(BACKENDS[name], model, tok, batches, args.threads))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(json.dumps(rows, indent=1) if args.json else table(rows, batches))


if __name__ == "__main__":
    main()
