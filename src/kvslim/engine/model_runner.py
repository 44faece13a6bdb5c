"""`ModelRunner`: all tensor work of a step. Owns the KV cache (allocated once, as its
`KVCachePlan` sizes it), turns the scheduler's decision into flat inputs + attention metadata,
runs the model and samples."""
from __future__ import annotations

import itertools
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvslim.attention import (PagedStepLayout, PrefillChunk, build_paged_attention,
                              decode_kernel_usable, resolve_attention_backend,
                              resolve_kv_cache_dtype)
from kvslim.device import host_tensor
from kvslim.dtypes import is_quantized_kv, packed_kv_bits
from kvslim.engine.block_table import BlockTables
from kvslim.engine.config import EngineConfig
from kvslim.engine.outputs import RankKVStats
from kvslim.engine.sampler import SampleRequest, SampleResult, Sampler
from kvslim.engine.scheduler import ScheduledSequence, SchedulerOutput
from kvslim.layers.rope import longrope_original_context
from kvslim.kv_cache.groups import first_needed_block
from kvslim.kv_cache.window import layer_spans
from kvslim.kernels.lowbit_codes import RESIDUAL_BLOCKS
from kvslim.kv_cache.plan import KVCachePlan, plan_kv_cache
from kvslim.models.causal_lm import CausalLM
from kvslim.structured.manager import StructuredOutputManager

if TYPE_CHECKING:
    from kvslim.engine.hidden_window import HiddenWindows
    from kvslim.engine.speculative.lookahead import TreeTokens
    from kvslim.engine.speculative.verify import TypicalAcceptance
    from kvslim.lora.manager import LoRAManager


def kv_cache_plan_of(model, config: EngineConfig, **given) -> KVCachePlan:
    """The KV-cache plan of a loaded model: its parameters' dtype and device resolve
    kv_cache_dtype ("auto": the model's dtype; fp8 where the device stores it). For a
    tensor-parallel shard `model.config` is the rank's: its cache, its capacity (the same on
    every rank). `given`: plan_kv_cache's num_blocks / max_model_len."""
    param = next(model.parameters())
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, param.dtype, param.device)
    if config.layer_plan is not None:       # each precision of the plan: its pool's dtype
        config.layer_plan.check_model(model.config.num_hidden_layers)
        given["pool_dtypes"] = {name: resolve_kv_cache_dtype(name, param.dtype, param.device)
                                for name in ("auto", *config.layer_plan.precisions)}
    return plan_kv_cache(model.config, kv_dtype, config, **given)


@dataclass
class RunnerFeatures:
    """What an engine plugs into its runner at construction (none by default)."""
    structured: StructuredOutputManager | None = None   # structured outputs' logits masks
    typical_acceptance: TypicalAcceptance | None = None  # speculation's typical acceptance
    # Medusa and EAGLE guess from the hidden states that drew each sequence's latest tokens:
    # kept per sequence when a proposer reads them.
    hidden_windows: HiddenWindows | None = None
    # Lookahead decoding reads the target's greedy token at every row of a tree of drafts
    # (its Jacobi iteration): kept per sequence after each step.
    tree_tokens: TreeTokens | None = None
    lora: LoRAManager | None = None                      # LoRA adapters' slots (enable_lora)


class ModelRunner:
    def __init__(self, model: CausalLM, config: EngineConfig, eos_token_ids,
                 kv_plan: KVCachePlan, features: RunnerFeatures | None = None):
        """Allocates the KV cache `kv_plan` sizes (`kv_cache_plan_of`)."""
        self.model = model
        self.config = config
        self.kv_plan = kv_plan
        mc = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = kv_plan.block_size
        spans = layer_spans(mc, config.window, config.layer_plan)   # fixed: not per step
        self.layer_windows = [s.window for s in spans]
        self.layer_sinks = [s.sinks for s in spans]
        # LongRoPE: each token's sequence says which factors rotate it (Sequence.long_rope)
        self.has_long_rope = longrope_original_context(mc.rope_scaling) is not None
        self.kv_groups = kv_plan.groups
        self.layer_group = self.kv_groups.group_of_layer()
        self.kv_dtype = kv_plan.kv_dtype
        self.bytes_per_block = kv_plan.bytes_per_block
        self.num_blocks = kv_plan.num_blocks
        dtypes = [pool.kv_dtype for pool in kv_plan.pools]
        self.group_pool = [0] * len(self.kv_groups.groups)
        for p, pool in enumerate(kv_plan.pools):
            for g in pool.groups:
                self.group_pool[g] = p
        self.attention_backend = resolve_attention_backend(
            config.attention_backend, self.device, any(map(is_quantized_kv, dtypes)),
            self.block_size, all(decode_kernel_usable(self.device, self.dtype, d) for d in dtypes),
            mc.mla is not None, any(self.layer_sinks))
        bits = [packed_kv_bits(d) for d in dtypes if packed_kv_bits(d)]
        self.packed_bits = min(bits) if bits else None
        # The blocks at a sequence's end whose K/V a packed cache keeps in float16.
        self.residual_blocks = max((RESIDUAL_BLOCKS[b] for b in bits), default=0)
        if self.packed_bits:
            from kvslim.attention.lowbit_cache import check_packed_cache
            check_packed_cache(self.attention_backend, config, mc)
        if config.kv_pressure == "demote":
            from kvslim.engine.kv_demotion import check_demotion
            check_demotion(self.attention_backend, self.kv_dtype == torch.float32,
                           mc.mla is not None)
        # Not with tensor parallelism: the graphs would capture the ranks' collectives too; not
        # with a packed cache, whose recent rows are laid out per step on the host.
        single = (not config.enforce_eager and config.tensor_parallel_size == 1
                  and not self.packed_bits and not config.enable_lora
                  and len(kv_plan.pools) == 1)
        use_graphs = self.device.type == "cuda" and single
        compiled = single and config.compile_decode        # on CUDA: inside the graphs
        self._allocate_cache(reserved_blocks=int(use_graphs or compiled))
        max_blocks_per_seq = -(-kv_plan.max_model_len // self.block_size)
        self.block_tables = BlockTables(
            config.max_num_seqs, max_blocks_per_seq, self.device, len(self.kv_groups.groups),
            [kv_plan.pools[p].first_block for p in self.group_pool])
        features = features or RunnerFeatures()
        self.sampler = Sampler(mc.vocab_size, self.device, eos_token_ids, config.seed,
                               features.structured, features.typical_acceptance)
        self.decode_graphs = (self._decode_graphs(use_graphs, compiled)
                              if use_graphs or compiled else None)
        self.hidden_windows = features.hidden_windows
        self.tree_tokens = features.tree_tokens
        self.lora = features.lora

    def _allocate_cache(self, reserved_blocks: int) -> None:
        """The cache's tensors (engine/kv_storage.py), `reserved_blocks` per pool beyond the
        plan's that the block manager never hands out."""
        from kvslim.engine.kv_storage import KVStorage      # not on `import kvslim`'s path
        self.storage = KVStorage(self.model.config, self.kv_plan, self.config, self.device,
                                 self.dtype, reserved_blocks)
        self.kv_caches, self.kv_cache = self.storage.kv_caches, self.storage.kv_cache
        self.kv_scales = self.storage.kv_scales

    def kv_stats(self, rank: int = 0) -> RankKVStats:
        """This runner's KV cache as allocated (rank: its tensor-parallel rank)."""
        return RankKVStats(rank, self.num_blocks, self.bytes_per_block, self.kv_slot_bytes,
                           self.kv_slot_bytes * len(self.kv_groups.groups))

    @property
    def kv_slot_bytes(self) -> int:
        return self.storage.slot_bytes()

    def _decode_graphs(self, use_graphs: bool, compiled: bool = False):
        """Every padded decode shape prepared now (compiled, then captured with CUDA graphs, or
        run once), before the first step. Padding rows write into the reserved block after the
        last one in use."""
        from kvslim.engine.decode_graphs import DecodeGraphs
        graphs = DecodeGraphs(self.model, self.kv_caches, self.num_blocks * self.block_size,
                              self.config.max_num_seqs, self.block_tables.max_blocks,
                              self.layer_windows, self.layer_group, use_graphs,
                              self.attention_backend, compiled, self.layer_sinks)
        graphs.prepare()
        return graphs

    def enable_padded_decode(self) -> None:
        """Run pure decode steps through the decode-graph path without CUDA graphs: padded
        batches from static buffers, executed eagerly. This is the CUDA path's logic on any
        device (tests); call it before the first step, as it reallocates the (empty) cache."""
        self._allocate_cache(reserved_blocks=1)
        self.decode_graphs = self._decode_graphs(use_graphs=False)

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.block_tables.release(seq_id)
            if self.hidden_windows is not None:
                self.hidden_windows.pop(seq_id)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, draft_probs: dict[int, torch.Tensor] | None = None,
                sample: bool = True) -> dict[int, list[SampleResult]]:
        """Run the step and sample: per sequence, its results (n > 1 parents: one per
        completion; speculative entries: the accepted drafts, then one more token).
        `draft_probs` holds a draft model's distributions for its drafts, by seq_id.
        sample=False: a tensor-parallel worker's step, the same forward and the same logits
        calls (each a collective every rank must join), but only rank 0 samples."""
        if sample:
            self.sampler.start_masks([(e.seq, e.draft_token_ids) for e in out.scheduled
                                      if e.sample or e.draft_token_ids])
        hidden, entries, query_starts = self.forward(out)
        draft_probs = draft_probs or {}
        spec_rows, sample_rows, requests, spec = [], [], [], []
        for entry, query_start in zip(entries, query_starts):
            scored = entry.prompt_logprob_positions
            if scored:
                from kvslim.engine.prompt_logprobs import record_prompt_logprobs
                record_prompt_logprobs(self.model, hidden, query_start + scored.start - entry.start,
                                       scored, entry.seq)
            if entry.draft_token_ids:        # every row scores a draft, the last one the bonus
                spec.append((entry, len(spec_rows)))
                spec_rows.extend(range(query_start, query_start + entry.num_tokens))
            elif entry.sample:
                requests.append(SampleRequest(entry.seq, entry.num_samples))
                sample_rows.append(query_start + entry.num_tokens - 1)
        if not spec_rows and not sample_rows:
            return {}
        logits = self.model.compute_logits(hidden[spec_rows + sample_rows])   # one lm_head call
        if not sample:
            return {}
        results: dict[int, list[SampleResult]] = {}
        paths: dict[int, list[int]] = {}     # a tree's accepted rows, by seq_id
        for entry, first in spec:
            seq, drafts = entry.seq, entry.draft_token_ids
            rows = logits[first:first + entry.num_tokens]
            if entry.draft_parents is not None:
                results[seq.seq_id], paths[seq.seq_id] = self.sampler.verify_tree(
                    rows, seq, drafts, entry.draft_parents)
                if self.tree_tokens is not None:
                    self.tree_tokens.keep(seq.seq_id, rows.argmax(dim=-1).tolist())
                continue
            q = draft_probs.get(seq.seq_id)
            results[seq.seq_id] = self.sampler.verify(rows, seq, drafts,
                                                      None if q is None else q[:len(drafts)])
        if requests:
            sampled = self.sampler(logits[len(spec_rows):], requests)
            results.update((r.seq.seq_id, res) for r, res in zip(requests, sampled))
        if paths:
            self._move_accepted_paths(entries, paths)
        if self.hidden_windows is not None:
            self._keep_hidden(hidden, entries, query_starts, results, paths)
        return results

    def _move_accepted_paths(self, entries: list[ScheduledSequence],
                             paths: dict[int, list[int]]) -> None:
        """A tree's accepted rows hold their K/V in the slots the tree gave them: move them to
        the positions they now have (row path[j] -> start + j), in every layer and group, so
        the sequence's cache is what plain decoding would have written."""
        moves = [(entry.seq, entry.start + r, entry.start + j) for entry in entries
                 for j, r in enumerate(paths.get(entry.seq.seq_id, ())) if r != j]
        if not moves:
            return
        seqs, src, dst = zip(*moves)
        rows = torch.tensor(self.block_tables.rows_of(list(seqs)), device=self.device)
        src, dst = (torch.tensor(p, device=self.device) for p in (src, dst))
        for group in range(len(self.kv_groups.groups)):
            from_slots = self.block_tables.slots(group, rows, src, self.block_size)
            to_slots = self.block_tables.slots(group, rows, dst, self.block_size)
            for tensor in self.storage.pool_tensors[self.group_pool[group]]:
                flat = tensor.view(tensor.shape[0], -1, *tensor.shape[3:])
                flat[:, to_slots] = flat[:, from_slots]        # gathered before written

    def _keep_hidden(self, hidden, entries, query_starts, results, paths) -> None:
        """Each sequence's rows whose next token is now known: a prefill chunk's and a decode's
        every row, a verification's rows up to the one that drew its last token (a tree's:
        those on its accepted path)."""
        for entry, query_start in zip(entries, query_starts):
            seq_id = entry.seq.seq_id
            if entry.num_samples > 1:
                continue                     # forks: the children decode on their own
            if seq_id in paths:
                kept = hidden[[query_start + r for r in paths[seq_id]]]
            else:
                n = len(results[seq_id]) if entry.draft_token_ids else entry.num_tokens
                kept = hidden[query_start:query_start + n]
            self.hidden_windows.keep(seq_id, entry.start, kept)

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput
                ) -> tuple[torch.Tensor, list[ScheduledSequence], list[int]]:
        """The model over the step's tokens: final hidden states [tokens, hidden], the entries
        in the order of their rows, and each entry's first row."""
        if out.demotions:                   # before the copies: one may write a source
            self.storage.demote_blocks(out.demotions)
        if out.block_copies:
            self.storage.copy_blocks(out.block_copies)
        entries = _attention_order(out.scheduled)
        input_ids, positions, long_rope, layouts, query_starts = self._prepare(entries)
        hidden = None
        # A decode's sequence is longer than LongRoPE's original context exactly when its
        # position lies beyond it: the decode graphs need no flags.
        if self.decode_graphs is not None and not layouts[0].prefills:
            hidden = self.decode_graphs.run(input_ids, positions, layouts)
        if hidden is None:
            attn = build_paged_attention(self.attention_backend, self.kv_caches, layouts,
                                         self.layer_windows, self.layer_group, self.layer_sinks)
            with self.lora.step(entries) if self.lora is not None else nullcontext():
                hidden = self.model(input_ids, positions, attn=attn, long_rope=long_rope)
        return hidden, entries, query_starts

    def _first_block(self, group: int, position: int) -> int:
        """The first block a query at `position` reads in `group`: a window group's attention
        skips the blocks before its window (released, or stale), except on the decode-graph
        path, whose tables have fixed widths."""
        window = self.kv_groups.groups[group].window
        if window is None or self.decode_graphs is not None or self.kv_groups.groups[group].sinks:
            return 0
        return first_needed_block(position, window, self.block_size)

    def _prepare(self, entries: list[ScheduledSequence]):
        """Flat inputs of the step (one-token queries first, then longer chunks), their layout
        for attention in each KV-cache group (same tokens, the group's own blocks), and each
        entry's first row in the flat layout. Everything the host decides is decided from
        Python values, and the inputs reach the device in one copy that does not wait for it.
        With LongRoPE, also each token's Sequence.long_rope (else None)."""
        nd = sum(1 for e in entries if e.num_tokens == 1)
        rows = self.block_tables.rows_for(entries)
        tokens = [e.seq.token_ids[e.start] for e in entries[:nd]]
        positions = [e.start for e in entries[:nd]]
        token_rows = rows[:nd]
        trees = [e.tree for e in entries[nd:]]
        for entry, row, tree in zip(entries[nd:], rows[nd:], trees):
            tokens += entry.input_token_ids
            positions += (range(entry.start, entry.start + entry.num_tokens) if tree is None
                          else [entry.start + d for d in tree.depths])
            token_rows += [row] * entry.num_tokens
        rows_of_inputs = [tokens, positions, token_rows]
        if self.has_long_rope:
            rows_of_inputs.append([int(e.seq.long_rope) for e in entries
                                   for _ in range(e.num_tokens)])
        if any(trees):        # a tree's rows sit in consecutive slots, not at their positions
            rows_of_inputs.append(positions[:nd] + [p for e in entries[nd:] for p in range(
                e.start, e.start + e.num_tokens)])
        input_ids, pos, rows_t, *extra = host_tensor(rows_of_inputs, torch.long, self.device)
        long_rope = extra.pop(0).bool() if self.has_long_rope else None
        slot_pos = extra[0] if extra else pos
        layouts = [self._layout(g, slot_pos, rows_t, entries, rows, nd, trees)
                   for g in range(len(self.kv_groups.groups))]
        query_starts = list(itertools.accumulate((e.num_tokens for e in entries[:-1]), initial=0))
        return input_ids, pos, long_rope, layouts, query_starts

    def _layout(self, group: int, pos: torch.Tensor, rows_t: torch.Tensor,
                entries: list[ScheduledSequence], rows: list[int], nd: int,
                trees: list) -> PagedStepLayout:
        """One KV-cache group's layout of the step; pos and rows_t are every token's slot
        position and block-table row, on the device; trees: each chunk's TreeRows or None."""
        bs, table = self.block_size, self.block_tables.table[group]
        layout = PagedStepLayout(slot_mapping=self.block_tables.slots(group, rows_t, pos, bs))
        layer = self.kv_groups.groups[group].layers[0]
        if getattr(self.kv_caches[layer], "packed", False):
            from kvslim.attention.lowbit_cache import recent_rows
            first = self.block_tables.group_first_block[group]    # pool-local ids
            tables = [e.seq.block_tables[group] for e in entries]
            if first:                  # a plan's later pool (a uniform cache's is the pool)
                tables = [[b - first for b in table] for table in tables]
            layout.recent = recent_rows([(row, e.start, e.num_tokens, table)
                                         for e, row, table in zip(entries, rows, tables)], bs,
                                        self.config.max_num_seqs,
                                        self.kv_caches[layer].recent_blocks,
                                        self.kv_caches[layer].residual, self.device)
        if nd:
            starts = [e.start for e in entries[:nd]]
            first = min(self._first_block(group, start) for start in starts)
            layout.num_decode_tokens = nd
            layout.decode_block_tables = table[rows_t[:nd], first:max(starts) // bs + 1]
            layout.decode_key_start = first * bs
            layout.decode_context_lens = pos[:nd] + 1
        query_start = nd
        for entry, row, tree in zip(entries[nd:], rows[nd:], trees):
            end = entry.start + entry.num_tokens
            first = self._first_block(group, entry.start)
            layout.prefills.append(PrefillChunk(
                query_start=query_start, query_len=entry.num_tokens, context_len=end,
                block_table=table[row, first:-(-end // bs)], key_start=first * bs, tree=tree))
            query_start += entry.num_tokens
        return layout


def _attention_order(entries: list[ScheduledSequence]) -> list[ScheduledSequence]:
    """One-token queries first: attention reads all of them in one batched call (a layout
    choice of the attention backend; what each row means comes from the entry)."""
    return ([e for e in entries if e.num_tokens == 1]
            + [e for e in entries if e.num_tokens != 1])
