"""`DraftModelProposer`: drafts from a cheaper model that shares the target's tokenizer (a
small model trained for it, or the target's own 4-bit or MQA copy).

The draft keeps its own paged KV cache and block manager, sized for as many tokens as the
target's cache, and one mirror sequence per target sequence. Each step it catches up on the
tokens the target accepted since (one chunk per sequence), then runs one-token steps until it
has k drafts, every sequence batched in each forward pass. The K/V of drafts the target
rejected are dropped by moving the mirror's computed length back to the common prefix."""
from __future__ import annotations

from dataclasses import replace

import torch

from kvslim.device import resolve_device
from kvslim.engine.block_manager import BlockManager
from kvslim.engine.config import EngineConfig
from kvslim.engine.model_runner import ModelRunner, kv_cache_plan_of
from kvslim.engine.sampler import PenaltyState, filter_probs, process_rows
from kvslim.engine.scheduler import ScheduledSequence, SchedulerOutput
from kvslim.engine.sequence import Sequence
from kvslim.engine.speculative.config import MAX_SPECULATIVE_TOKENS
from kvslim.errors import KvslimError
from kvslim.formats.loader import load_model
from kvslim.kernels.activations import linear_activations
from kvslim.models.config import ModelConfig

Drafts = dict[int, tuple[list[int], torch.Tensor]]      # seq_id -> (tokens, q [k, vocab])


class DraftModelProposer:
    def __init__(self, model_dir, engine_config: EngineConfig, target_num_blocks: int,
                 max_model_len: int, target_vocab_size: int, eos_token_ids=()):
        vocab = ModelConfig.from_dir(model_dir).vocab_size
        if vocab != target_vocab_size:
            raise KvslimError(f"the draft model's vocabulary ({vocab} tokens) differs from the "
                              f"target's ({target_vocab_size}): a draft must share the target's "
                              "tokenizer")
        model = load_model(model_dir, dtype=engine_config.dtype,
                           device=resolve_device(engine_config.device))
        with linear_activations(engine_config.linear_activations):
            model.prepare_for_inference()
        # The draft rolls its mirrors back to a common prefix, so it keeps every block (one
        # group, windows only masked); its cache holds as many blocks as the target's.
        config = replace(engine_config, speculative=None, enforce_eager=True,
                         keep_out_of_window_blocks=True)
        self._setup(model, config, target_num_blocks, max_model_len, eos_token_ids)

    def _setup(self, model, config: EngineConfig, num_blocks: int, max_model_len: int,
               eos_token_ids) -> None:
        """Its runner over `model` with a cache of `num_blocks` blocks, its block manager and
        mirrors."""
        param = next(model.parameters())
        plan = kv_cache_plan_of(model, config, num_blocks=num_blocks,
                                max_model_len=max_model_len)
        self.runner = ModelRunner(model, config, [], plan)
        groups = self.runner.kv_groups
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          enable_prefix_caching=False,
                                          group_windows=groups.windows,
                                          group_sinks=groups.sinks)
        self.mirrors: dict[int, Sequence] = {}
        # q is processed as the target's p is (bias, penalties, min_tokens), so drafts stay
        # likely under the request's own sampling rules.
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(device=param.device).manual_seed(config.seed + 1)

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.num_blocks * self.runner.bytes_per_block

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> Drafts:
        """Up to limits[i] drafts for seqs[i], with the distributions they were drawn from.
        A sequence whose draft cache has no room gets none this step."""
        live = []
        for seq, k in zip(seqs, limits):
            if k <= 0:
                continue
            mirror = self._sync(seq)
            needed = mirror.num_uncomputed_tokens + k - 1     # the last draft is never fed
            if self.block_manager.can_append(mirror, needed):
                self.block_manager.append_slots(mirror, needed)
                live.append((seq, mirror, k))
        drafts: Drafts = {seq.seq_id: ([], []) for seq, _, _ in live}
        for step in range(max((k for _, _, k in live), default=0)):
            active = [(seq, mirror) for seq, mirror, k in live if step < k]
            for (seq, mirror), (token, q) in zip(active, self._step([m for _, m in active])):
                drafts[seq.seq_id][0].append(token)
                drafts[seq.seq_id][1].append(q)
        return {sid: (tokens, torch.stack(qs)) for sid, (tokens, qs) in drafts.items()}

    def _step(self, mirrors: list[Sequence]) -> list[tuple[int, torch.Tensor]]:
        """One forward pass over every mirror's uncomputed tokens (their slots reserved by
        `propose`); draws each one's next token from the last row."""
        entries = [ScheduledSequence(m, m.num_uncomputed_tokens, True,
                                     start=m.num_computed_tokens,
                                     table_changes=self.block_manager.take_changes(m))
                   for m in mirrors]
        hidden, ordered, starts = self.runner.forward(SchedulerOutput(entries))
        rows = [start + e.num_tokens - 1 for e, start in zip(ordered, starts)]
        logits = self.runner.model.compute_logits(hidden[rows]).float()
        drawn = {}
        for entry, row_logits in zip(ordered, logits):
            mirror, p = entry.seq, entry.seq.params
            state = (PenaltyState(mirror, len(row_logits), row_logits.device)
                     if p.uses_penalties else None)
            process_rows(row_logits[None], mirror, [], state, self.eos_token_ids)
            if p.greedy:
                q = torch.zeros_like(row_logits)
                q[int(row_logits.argmax())] = 1.0
            else:
                q = filter_probs(row_logits[None] / p.temperature, [p.top_k], [p.top_p],
                                 [p.min_p])[0]
            token = int(torch.multinomial(q, 1, generator=self.generator))
            mirror.num_computed_tokens += entry.num_tokens
            mirror.token_ids.append(token)
            drawn[mirror.seq_id] = (token, q)
        return [drawn[m.seq_id] for m in mirrors]

    def _sync(self, seq: Sequence) -> Sequence:
        """The mirror of `seq`, holding its tokens, with K/V kept for the common prefix."""
        mirror = self.mirrors.get(seq.seq_id)
        if mirror is None:
            groups = self.block_manager.num_groups          # one table per KV-cache group
            mirror = Sequence(request_id=seq.request_id, token_ids=list(seq.token_ids),
                              params=seq.params, block_size=seq.block_size,
                              num_prompt_tokens=seq.num_prompt_tokens,
                              block_tables=[[] for _ in range(groups)],
                              registered_blocks=[0] * groups, dirty_from=[0] * groups)
            self.mirrors[seq.seq_id] = mirror
            return mirror
        # Only the drafted tail can differ: the tokens before it were the target's own. The
        # last token is always fed again: its logits give the first draft.
        limit = min(mirror.num_computed_tokens, seq.num_tokens - 1)
        common = max(0, min(limit, len(mirror.token_ids) - MAX_SPECULATIVE_TOKENS - 1))
        while common < limit and mirror.token_ids[common] == seq.token_ids[common]:
            common += 1
        mirror.token_ids = list(seq.token_ids)
        mirror.num_computed_tokens = common
        self.block_manager.trim(mirror, common)
        return mirror

    def release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            mirror = self.mirrors.pop(seq_id, None)
            if mirror is not None:
                self.block_manager.free(mirror)
                self.runner.release([mirror.seq_id])
