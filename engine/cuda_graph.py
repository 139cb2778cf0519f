"""CUDA graphs for decode-only steps.

A decode step at batch 16 launches a few hundred small kernels, and on a fast GPU launching them
takes longer than running them. A CUDA graph records the launches once and replays them with one
call. A graph replays fixed shapes at fixed addresses, so:

  - graphs are captured for a few batch sizes (buckets); a step of n decodes runs the smallest
    bucket >= n, its extra rows padded to do harmless work: token 0 at position 0, written to a
    scratch block that no sequence owns;
  - inputs live in static buffers that each step copies into before the replay; attention reads
    block tables up to the longest context the model allows, so any context length fits;
  - steps with a prefill chunk, larger batches and CPUs run eagerly.
"""
from __future__ import annotations

import torch

from engine.attention import AttentionMetadata, set_metadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16, up to the first size >= max_num_seqs."""
    sizes = []
    for b in [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16)):
        sizes.append(b)
        if b >= max_num_seqs:
            break
    return sizes


def bucket_for(n: int, sizes: list[int]) -> int | None:
    return next((b for b in sizes if b >= n), None)


def pad_decodes(step, size: int, scratch_block: int, block_size: int):
    """Pad a decode-only StepInputs to `size` rows; each extra row is token 0 at position 0 in the scratch block."""
    pad = size - len(step.input_ids)
    step.input_ids += [0] * pad
    step.positions += [0] * pad
    step.slots += [scratch_block * block_size] * pad
    step.query_lens += [1] * pad
    step.context_lens += [1] * pad
    step.block_tables += [[scratch_block]] * pad
    step.num_decodes = size
    return step


class DecodeGraphs:
    """Static buffers and one captured decode forward per bucket. capture=False runs the same
    region eagerly on each call (how tests check the buffers and padding on a CPU)."""

    def __init__(self, model, cos, sin, max_num_seqs: int, max_blocks: int, scratch_block: int, block_size: int,
                 capture: bool = True):
        self.model, self.cos, self.sin = model, cos, sin
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_blocks = max_blocks
        b, dev = self.sizes[-1], cos.device
        # idle values describe a padded row, so every captured size starts from valid inputs
        self.input_ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slots = torch.full((b,), scratch_block * block_size, dtype=torch.long, device=dev)
        self.context_lens = torch.ones(b, dtype=torch.long, device=dev)
        self.block_tables = torch.full((b, max_blocks), scratch_block, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(b, model.cfg.hidden_size, dtype=cos.dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture_all()

    def bucket(self, n: int) -> int | None:
        return bucket_for(n, self.sizes)

    def _forward(self, b: int):
        """The captured region: the model over the first b rows of the static buffers."""
        set_metadata(AttentionMetadata(slot_mapping=self.slots[:b], context_lens=self.context_lens[:b],
                                       block_tables=self.block_tables[:b], num_decodes=b,
                                       decode_blocks=self.max_blocks))
        pos = self.positions[:b]
        self.hidden[:b] = self.model(self.input_ids[:b], self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1))
        set_metadata(None)

    @torch.inference_mode()
    def _capture_all(self):
        pool = None
        with self.model.ops.fusing():         # the graphs hold the fused elementwise kernels
            for b in reversed(self.sizes):    # largest first: the smaller graphs reuse its memory pool
                self._forward(b)              # warm-up: torch.compile and Triton compile, cuBLAS picks kernels
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self._forward(b)
                pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.synchronize()

    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """One padded decode step (input rows == a bucket size). Returns hidden states (b, hidden)."""
        b, w = input_ids.shape[0], meta.block_tables.shape[1]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(meta.slot_mapping)
        self.context_lens[:b].copy_(meta.context_lens)
        self.block_tables[:b, :w].copy_(meta.block_tables)   # columns past w are never read
        if self.graphs:
            self.graphs[b].replay()
        else:
            self._forward(b)
        return self.hidden[:b]
