"""`DecodeGraphs`: pure-decode steps replayed as CUDA graphs.

A decode step of a small model on a GPU is a few hundred tiny kernels; launching them one by one
from Python costs more than running them. Like vLLM and nano-vllm, the engine records the whole
decoder for a decode batch once into a CUDA graph and then replays it with one launch per step.

A graph fixes every shape and address, so each one is recorded for a padded batch size
(`capture_batch_sizes`) and a padded block-table width (`capture_widths`), reading from static
buffers the step's inputs are copied into. All of them are recorded at start-up (`prepare`), so
no capture, and no compilation behind one, ever happens while serving; a step larger than every
prepared shape runs eagerly. Padding rows are harmless: they write their K/V into a scratch block
the block manager never hands out, attend to one cached position and their outputs are dropped.
On the CPU the same padded static-buffer path runs as one compiled program (`compiled`,
cpu_compile.py; at start-up only the shapes that meet its guards run), or eagerly, each shape
once at start-up too, which is how the tests check the CUDA path's logic. On CUDA a compiled
step is what the graphs record: Inductor's fused Triton kernels in place of the eager decoder's
few hundred small ones (a norm, RoPE, the residuals and their casts are a kernel each, eagerly),
compiled before the first capture."""
from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from kvslim.attention import PagedStepLayout, build_paged_attention
from kvslim.engine import cpu_compile


# The sizes of _model_step's inputs that vary between padded shapes: the batch and the width.
DYNAMIC_DIMS = ((0,), (0,), (1,), (1, 2), (0,))


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


def capture_widths(max_blocks: int, backend: str) -> list[int]:
    """Block-table widths graphs are recorded at. FlexAttention and the CPU decode kernel read
    the pool in place at any width (the width only sizes the step's tables): one width, the
    largest. The gather path
    copies width * block_size keys per decode: widths growing 4x, so a step's tables are padded
    to at most 4x what they need, with few graphs (4 up to 256 blocks, 5 up to 1024)."""
    if backend in ("flex", "kernel"):
        return [max_blocks]
    widths, width = [], 4
    while width < max_blocks:
        widths.append(width)
        width *= 4
    return widths + [max_blocks]


class DecodeGraphs:
    def __init__(self, model, kv_caches, scratch_slot: int, max_num_seqs: int,
                 max_blocks_per_seq: int, layer_windows: list[int | None],
                 layer_group: list[int] | None = None, use_graphs: bool = False,
                 backend: str = "gather", compiled: bool = False,
                 layer_sinks: list[int] | None = None):
        """layer_group: each layer's KV-cache group; every group has its own slot mapping and
        block tables (static buffers [groups, ...]). backend: the resolved attention backend.
        compiled: run the step as a compiled program (with use_graphs, the graphs record it).
        Call `prepare` before the first step."""
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        layer_group = layer_group or [0] * len(layer_windows)
        self.layer_windows, self.layer_group = layer_windows, layer_group
        self.layer_sinks = layer_sinks
        num_groups = max(layer_group) + 1
        self.use_graphs = use_graphs
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        self.widths = capture_widths(max_blocks_per_seq, backend)
        self.max_blocks = max_blocks_per_seq
        self.block_size = kv_caches[0].block_size
        self.scratch_slot = scratch_slot
        dev = kv_caches[0].device
        n = self.batch_sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((num_groups, n), scratch_slot, dtype=torch.long,
                                       device=dev)
        self.context_lens = torch.ones(n, dtype=torch.long, device=dev)
        # One column more than the widest table: a slice as wide as its buffer is a shape the
        # compiler specializes on (a program of its own).
        self.block_tables = torch.zeros(num_groups, n, max_blocks_per_seq + 1, dtype=torch.long,
                                        device=dev)
        # Prepared shapes: their graph and its output buffer, or None on the eager path.
        self.graphs: dict[tuple[int, int], tuple[object, torch.Tensor] | None] = {}
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.compiled = None
        if compiled:
            reason = cpu_compile.missing_compiler(dev)
            if reason is None:
                cpu_compile.use_compile_cache()
                self.compiled = cpu_compile.CompiledStep(self._model_step, DYNAMIC_DIMS)
            else:
                cpu_compile.note(f"{reason}: decode steps run eagerly")

    def shape_for(self, num_seqs: int, num_blocks: int) -> tuple[int, int] | None:
        """The padded (batch, table width) a step runs at, or None when it is too large."""
        batch = next((b for b in self.batch_sizes if b >= num_seqs), None)
        width = next((w for w in self.widths if w >= num_blocks), None)
        return None if batch is None or width is None else (batch, width)

    @torch.inference_mode()
    def prepare(self) -> None:
        """Record every padded shape, largest batch first (later, smaller graphs reuse its
        memory pool); eagerly, run each once; compiled, those of `_shapes_to_run`. Every row
        is padding meanwhile."""
        shapes = [(b, w) for b in reversed(self.batch_sizes) for w in self.widths]
        if self.compiled is not None:
            self._compile(shapes)
        runs = self._shapes_to_run(shapes)
        for batch, width in shapes:
            self._pad(0, batch)
            if self.use_graphs:
                self.graphs[(batch, width)] = self._capture(batch, width)
                continue
            if (batch, width) in runs:
                self._forward(batch, width)
            self.graphs[(batch, width)] = None
        if self.compiled is not None:
            self.compiled.freeze()          # from here on nothing compiles

    def _shapes_to_run(self, shapes: list[tuple[int, int]]) -> set[tuple[int, int]]:
        """The shapes run once at start-up. Eagerly, every one. The compiled programs leave the
        batch and the width symbolic: every batch at the narrowest width and every width at
        the smallest batches meet every guard that tells the programs apart, without the
        widest steps (64 rows x 8192 keys through 30 layers took minutes at start-up)."""
        if self.compiled is None:
            return set(shapes)
        narrow = min(w for _, w in shapes)
        small = sorted({b for b, _ in shapes})[:2]
        return {(b, w) for b, w in shapes if w == narrow or b in small}

    def _compile(self, shapes: list[tuple[int, int]]) -> None:
        """Build the programs that cover `shapes` (one row, and from two rows up), with a
        progress bar; a compiler failure leaves the eager path, with a note."""
        firsts = [shapes[0]] + [(1, w) for b, w in shapes if b == 1][:1]
        bar = tqdm(firsts, desc="compiling the decode step (cached for the next start)",
                   unit="program", file=sys.stderr)
        try:
            for batch, width in bar:
                self._pad(0, batch)
                self._forward(batch, width)
        except Exception as e:          # a missing or failing compiler: never a crash
            cpu_compile.note(f"decode step not compiled ({cpu_compile.first_line(e)}): "
                             "decode steps run eagerly")
            self.compiled = None
        finally:
            bar.close()

    @property
    def compilations(self) -> int:
        """Programs the compiled step has built (0 when it runs eagerly)."""
        return 0 if self.compiled is None else self.compiled.compilations

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            layouts: list[PagedStepLayout]) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a pure decode step (one layout per KV-cache group), or
        None if it must run eagerly (no prepared shape fits)."""
        n, width = input_ids.shape[0], layouts[0].decode_block_tables.shape[1]
        shape = self.shape_for(n, width)
        if shape not in self.graphs:
            return None
        self._fill(n, shape[0], input_ids, positions, layouts)
        recorded = self.graphs[shape]
        if recorded is None:
            return self._forward(*shape)[:n]
        graph, hidden = recorded
        graph.replay()
        return hidden[:n]

    def _fill(self, n: int, batch: int, input_ids, positions,
              layouts: list[PagedStepLayout]) -> None:
        """Copy the step into the static buffers (device to device: no host synchronisation).
        Table columns past the step's width keep older ids: every backend ignores entries past
        a row's context length."""
        width = layouts[0].decode_block_tables.shape[1]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.context_lens[:n] = layouts[0].decode_context_lens
        for g, layout in enumerate(layouts):
            self.slot_mapping[g, :n] = layout.slot_mapping
            self.block_tables[g, :n, :width] = layout.decode_block_tables
        self._pad(n, batch)

    def _pad(self, n: int, batch: int) -> None:
        # Padding rows: position 0, one key, K/V written into the scratch block.
        self.input_ids[n:batch] = 0
        self.positions[n:batch] = 0
        self.slot_mapping[:, n:batch] = self.scratch_slot
        self.context_lens[n:batch] = 1

    def _forward(self, batch: int, width: int) -> torch.Tensor:
        """The decoder over the static buffers' first `batch` rows and `width` table columns."""
        step = self.compiled or self._model_step
        return step(self.input_ids[:batch], self.positions[:batch], self.slot_mapping[:, :batch],
                    self.block_tables[:, :batch, :width], self.context_lens[:batch])

    def _model_step(self, input_ids, positions, slot_mapping, block_tables, context_lens):
        """What is compiled: every input a tensor, so that the batch and the table width are
        the only sizes a compiled program leaves open (cpu_compile.py)."""
        layouts = [PagedStepLayout(
            slot_mapping=slot_mapping[g], num_decode_tokens=input_ids.shape[0],
            decode_block_tables=block_tables[g], decode_context_lens=context_lens)
            for g in range(slot_mapping.shape[0])]
        attn = build_paged_attention(self.backend, self.kv_caches, layouts, self.layer_windows,
                                     self.layer_group, self.layer_sinks)
        return self.model(input_ids, positions, attn=attn)

    def _capture(self, batch: int, width: int):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):          # warm-up: lazy inits happen outside capture
            self._forward(batch, width)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._forward(batch, width)
        return graph, hidden
