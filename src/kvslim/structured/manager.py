"""`StructuredOutputManager`: one grammar matcher per constrained completion, the bitmasks of a
step's rows, and the tokens fed back once they are drawn.

The masks of a step depend only on the tokens already appended, so `start_masks` fills them on a
worker thread (llguidance's executor, which leaves the GIL) while the model runs, and the
sampler waits for them after the forward pass. A row of a speculative step scores the draft
tokens before it: its mask is the grammar's state after those drafts, then the matcher is rolled
back, so a draft the grammar forbids is rejected by the ordinary verification rule.

A JSON answer (a schema, or any object) also keeps a closer (a `SchemaCloser` where the schema
allows, else a `JsonCloser`): when what is left of `max_tokens` would no longer hold the closing
text after one more free token, the rows allow only the closing's next token, so the answer ends
as JSON that parses (and matches its schema) instead of being cut. Behind a reasoning parser's
thinking, the closer is a `ThinkingCloser`: a closing due while the model thinks writes
`</think>` first."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvslim.structured.grammar import GrammarCompiler, _llguidance
from kvslim.structured.json_closer import JsonCloser

if TYPE_CHECKING:
    from kvslim.reasoning.parser import ReasoningFormat
    from kvslim.structured.schema_shape import SchemaShape


class Sequence(Protocol):
    """What this room reads of the engine's Sequence (engine/sequence.py)."""
    request_id: str
    index: int
    seq_id: int
    output_token_ids: list[int]
    params: object                                     # its max_tokens: the budget

Key = tuple[str, int]                                  # (request_id, completion index)


@dataclass
class MaskTimes:
    """Seconds spent, summed over steps (kvslim bench structured reads them)."""
    steps: int = 0
    fill_s: float = 0.0       # on the worker thread, beside the forward pass
    wait_s: float = 0.0       # what the step waited for the masks after its forward pass


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler, vocab_size: int, threads: int = 1):
        self.compiler = compiler
        self.words = (vocab_size + 31) // 32
        self.grammars: dict[str, str] = {}               # request_id -> compiled grammar
        self.matchers: dict[Key, object] = {}
        self._threads = threads
        self._executor = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._ready: dict[int, torch.Tensor] = {}
        self.errors: dict[str, str] = {}                 # request_id -> why its grammar failed
        # Closed before max_tokens cuts them: request_id -> what closing needs of its schema.
        self.json_requests: dict[str, SchemaShape | None] = {}
        self.closers: dict[Key, JsonCloser] = {}
        self.reasoning: dict[str, ReasoningFormat] = {}    # request_id -> its thinking's tags
        self.forced: dict[Key, dict[int, int]] = {}      # row -> the closing token it allowed
        self.times = MaskTimes()

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, grammar: str, is_json: bool = False,
                    reasoning: ReasoningFormat | None = None) -> None:
        """`reasoning`: the grammar binds the answer after the thinking (compiled so); a JSON
        answer's closing then ends the thinking first."""
        self.grammars[request_id] = grammar
        if is_json:
            self.json_requests[request_id] = self.compiler.shape(grammar)
        if reasoning is not None:
            self.reasoning[request_id] = reasoning

    def is_constrained(self, seq: Sequence) -> bool:
        return seq.request_id in self.grammars

    def release(self, seq: Sequence) -> None:
        key = _key(seq)
        for table in (self.matchers, self.closers, self.forced):
            table.pop(key, None)

    def forget_request(self, request_id: str) -> None:
        self.grammars.pop(request_id, None)
        self.json_requests.pop(request_id, None)
        self.reasoning.pop(request_id, None)
        for table in (self.matchers, self.closers, self.forced):
            for key in [k for k in table if k[0] == request_id]:
                del table[key]

    def closed_for_budget(self, seq: Sequence) -> bool:
        """Whether the answer's JSON was closed because max_tokens was near (its finish is then
        "length": complete JSON, but not the answer the model would have given)."""
        closer = self.closers.get(_key(seq))
        return closer is not None and closer.forcing

    def _matcher(self, seq: Sequence):
        key = _key(seq)
        matcher = self.matchers.get(key)
        if matcher is None:
            matcher = self.compiler.matcher(self.grammars[seq.request_id])
            # Made when the completion first samples (a preempted one keeps its matcher, a
            # fork's siblings copy their parent's in `accept`); one made later all the same
            # replays the output so far.
            if seq.output_token_ids and not matcher.consume_tokens(seq.output_token_ids):
                self.errors.setdefault(seq.request_id, "the grammar rejected the output so far")
            self.matchers[key] = matcher
            if seq.request_id in self.json_requests and key not in self.closers:
                self.closers[key] = closer = self._closer(seq.request_id)
                closer.feed(self.compiler.token_bytes(seq.output_token_ids))
        return matcher

    def _closer(self, request_id: str):
        closer = self.compiler.closer(self.json_requests[request_id])
        if request_id not in self.reasoning:
            return closer
        from kvslim.structured.after_reasoning import ThinkingCloser
        return ThinkingCloser(closer, self.reasoning[request_id])

    # ---- masks ---------------------------------------------------------------------------
    def start_masks(self, items: list[tuple[Sequence, list[int]]]) -> None:
        """Begin filling the masks of a step's constrained rows: per (sequence, drafts), one row
        after each prefix of the drafts (a plain decode has no drafts: one row)."""
        self._ready = {}
        items = [(seq, drafts) for seq, drafts in items if self.is_constrained(seq)] \
            if self.grammars else []
        if not items:
            self._pending = None
            return
        for seq, _ in items:
            self._matcher(seq)                            # created on this thread
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvslim-grammar")
        self._pending = self._pool.submit(self._fill, items)

    def masks(self) -> dict[int, torch.Tensor]:
        """seq_id -> its rows' bitmasks [rows, words] (int32), for the step started last."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            start = time.perf_counter()
            self._ready = pending.result()
            self.times.wait_s += time.perf_counter() - start
        return self._ready

    def _fill(self, items: list[tuple[Sequence, list[int]]]) -> dict[int, torch.Tensor]:
        start = time.perf_counter()
        out = self._fill_rows(items)
        self.times.steps += 1
        self.times.fill_s += time.perf_counter() - start
        return out

    def _fill_rows(self, items: list[tuple[Sequence, list[int]]]) -> dict[int, torch.Tensor]:
        llg = _llguidance()
        import llguidance.torch as llg_torch
        if self._executor is None:
            self._executor = llg.LLExecutor(num_threads=self._threads)
        plain = [(seq, self._matcher(seq)) for seq, drafts in items if not drafts]
        out: dict[int, torch.Tensor] = {}
        if plain:
            bitmask = torch.zeros(len(plain), self.words, dtype=torch.int32)
            llg_torch.fill_next_token_bitmask_par(
                self._executor, [(m, i) for i, (_, m) in enumerate(plain)], bitmask)
            out.update((seq.seq_id, bitmask[i:i + 1]) for i, (seq, _) in enumerate(plain))
            for i, (seq, _) in enumerate(plain):
                self._close_if_due(seq, bitmask[i], 0, self.closers.get(_key(seq)))
        for seq, drafts in items:
            if drafts:
                out[seq.seq_id] = self._draft_rows(seq, self._matcher(seq), drafts)
        return out

    def _draft_rows(self, seq: Sequence, matcher, drafts: list[int]) -> torch.Tensor:
        """Row i: the mask after drafts[:i] (closing JSON at that row's budget when due). Once a
        draft is forbidden, the rows after it can never be used (verification stops there):
        they allow everything."""
        rows = torch.full((len(drafts) + 1, self.words), -1, dtype=torch.int32)
        closer = self.closers.get(_key(seq))
        closer = closer.copy() if closer is not None else None
        consumed = 0
        for i in range(len(drafts) + 1):
            matcher.unsafe_compute_mask_ptr(rows[i].data_ptr(), self.words * 4)
            self._close_if_due(seq, rows[i], i, closer)
            if i == len(drafts) or not allows(rows[i], drafts[i]) \
                    or not matcher.consume_token(drafts[i]):
                break
            consumed += 1
            if closer is not None:
                self._advance(closer, drafts[i], self.forced.get(_key(seq), {}).get(i))
        if consumed:
            matcher.rollback(consumed)
        return rows

    def _close_if_due(self, seq: Sequence, row: torch.Tensor, ahead: int,
                      closer: JsonCloser | None) -> None:
        """Row `ahead` of `seq`'s step allows only the next closing token once closing is due:
        closing started already, or what writing the closing takes (its `cost`: at most one
        token a byte, or a SchemaCloser's count) plus the most one free token could add to it
        (`_growth`) no longer fits in the budget left. The invariant kept: after any free
        token, the closing still fits; once begun, it is written as the tokens it was cut into
        then (`plan`, no more than its cost), so it never grows."""
        if ahead == 0:
            self.forced.pop(_key(seq), None)
        closing = closer.closing() if closer is not None else None
        if not closing:                            # not JSON, unknown, or already complete
            return
        budget = seq.params.max_tokens - len(seq.output_token_ids) - ahead
        tokens_of = self.compiler.closing_tokens
        if not closer.forcing and closer.cost(tokens_of) + self._growth(closer) < budget:
            return
        token = closer.plan[0] if closer.plan else closer.closing_tokens(tokens_of)[0]
        if not allows(row, token):                 # the grammar wants more than this closing
            return
        row.zero_()
        row[token // 32] = _bit(token % 32)
        self.forced.setdefault(_key(seq), {})[ahead] = token

    def _growth(self, closer: JsonCloser) -> int:
        from kvslim.structured.schema_closer import SchemaCloser   # loaded by the closer's maker
        if hasattr(closer, "inner"):                       # a ThinkingCloser
            return max(closer.growth(self.compiler.closing_tokens), self._growth(closer.inner))
        if isinstance(closer, SchemaCloser) and not closer.lost:
            return closer.growth_bound(self.compiler.closing_probes,
                                       self.compiler.closing_tokens)
        return self.compiler.json_growth

    def _advance(self, closer: JsonCloser, token: int, forced: int | None) -> None:
        """Feed a drawn token; the closing's first forced token begins it (its plan: the
        closing's tokens), each later one is the plan's next."""
        if closer.forcing:
            closer.plan = closer.plan[1:] if closer.plan and closer.plan[0] == token else None
        elif forced == token:
            closer.forcing = True
            closer.plan = closer.closing_tokens(self.compiler.closing_tokens)[1:]
        closer.feed(self.compiler.token_bytes([token]))

    # ---- tokens --------------------------------------------------------------------------
    def accept(self, seq: Sequence, tokens: list[int], num_samples: int = 1) -> None:
        """Feed the drawn tokens: `tokens` are one completion's new tokens, or (num_samples >
        1, a parent about to fork) one token for each completion, the siblings' matchers
        copied from the parent's state first."""
        if not self.is_constrained(seq):
            return
        parent = self._matcher(seq)
        if num_samples > 1:
            for k in range(1, num_samples):
                sibling = (seq.request_id, seq.index + k)
                self.matchers[sibling] = parent.deep_copy()
                if _key(seq) in self.closers:
                    self.closers[sibling] = self.closers[_key(seq)].copy()
                    self.forced[sibling] = dict(self.forced.get(_key(seq), {}))
            runs = [((seq.request_id, seq.index + k), [t]) for k, t in enumerate(tokens)]
        else:
            runs = [(_key(seq), tokens)]
        for key, toks in runs:
            self._feed_closer(key, toks)
            matcher = self.matchers[key]
            if matcher.is_stopped():                 # the grammar is complete: EOS follows
                continue
            if not matcher.consume_tokens(toks):
                # The request's own fault (never the batch's): the engine ends it alone.
                self.errors.setdefault(seq.request_id, f"the grammar rejected token(s) {toks}: "
                                       f"{matcher.get_error().splitlines()[0]}")

    def _feed_closer(self, key: Key, tokens: list[int]) -> None:
        closer = self.closers.get(key)
        if closer is None:
            return
        forced = self.forced.pop(key, {})
        for i, token in enumerate(tokens):
            self._advance(closer, token, forced.get(i))

    def take_errors(self) -> dict[str, str]:
        errors, self.errors = self.errors, {}
        return errors


def _key(seq: Sequence) -> Key:
    return (seq.request_id, seq.index)


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the (signed) value torch stores."""
    return (1 << i) - (1 << 32 if i == 31 else 0)


def allows(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf for every token whose bit is 0 (rows of logits and of bitmask pair up;
    ids past the vocabulary's padding stay as they are in neither)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)
    vocab = logits.shape[-1]
    allowed = bits[:, :vocab].to(device=logits.device, dtype=torch.bool)
    if allowed.shape[1] < vocab:                          # a model vocab wider than the mask
        pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool,
                          device=logits.device)
        allowed = torch.cat([allowed, pad], dim=1)
    logits.masked_fill_(~allowed, float("-inf"))
