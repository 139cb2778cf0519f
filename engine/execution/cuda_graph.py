"""CUDA graphs for every step: one captured forward pass per token bucket.

A step launches hundreds of small kernels, and on a fast GPU launching them takes longer than running
them. A CUDA graph records the launches once and replays them with one call. A graph replays fixed
shapes at fixed addresses, so:

  - graphs are captured for token-count buckets (1, 2, 4, 8, then every 16 up to 256, then every 64)
    up to the token budget; bucket T holds up to S(T) = min(T, max_num_seqs) sequences (no step has
    more sequences than tokens). A step of n tokens and s sequences runs the smallest bucket with
    T >= n and S(T) >= s;
  - each graph is a whole forward pass: embedding, every layer (the unified attention kernel reads
    decodes and prefill chunks alike, its grid a function of T and S(T) only), the final norm and
    the logits of the S(T) rows that may sample;
  - padding: tokens past the real ones are token 0 at position 0, their K/V written to a scratch slot
    no sequence owns, their rows dropped; sequences past the real ones have no tokens (the kernel's
    programs for them return at once) and sample row 0, dropped too;
  - all step inputs live in one static int64 buffer (StepLayout), filled on the host in pinned memory
    and moved by one host-to-device copy; nothing in the captured region reads back to the host;
  - steps above the largest bucket (a whole prompt under continuous batching) and CPUs run eagerly,
    through the same kernel.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from engine.execution.attention import AttentionMetadata, set_metadata

log = logging.getLogger("batchscope.engine")


def token_buckets(max_tokens: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to 256, then every 64: up to the first size >= max_tokens."""
    sizes = []
    for t in [1, 2, 4, 8, *range(16, 257, 16), *range(320, max_tokens + 64, 64)]:
        sizes.append(t)
        if t >= max_tokens:
            break
    return sizes


def bucket_for(num_tokens: int, num_seqs: int, sizes: list[int], max_num_seqs: int) -> int | None:
    """The smallest bucket holding the step, or None (eager) when none does."""
    return next((t for t in sizes if t >= num_tokens and min(t, max_num_seqs) >= num_seqs), None)


@dataclass(frozen=True)
class StepLayout:
    """Offsets of every step input in one flat int64 buffer, sized for the largest bucket: tokens rows
    (ids, positions, slots), then per sequence (sample rows, cumulative query lengths, context lengths),
    then block tables last, so a step copies only the rows it uses."""
    tokens: int        # largest bucket
    seqs: int          # its sequences
    width: int         # blocks per table row (the longest context the model allows)

    @cached_property
    def offsets(self) -> dict[str, tuple[int, int]]:
        """name -> (first entry, entries), in buffer order."""
        t, s = self.tokens, self.seqs
        sizes = [("input_ids", t), ("positions", t), ("slots", t), ("sample_rows", s), ("cu_q", s + 1),
                 ("seq_lens", s), ("block_tables", s * self.width)]
        out, at = {}, 0
        for name, n in sizes:
            out[name] = (at, n)
            at += n
        return out

    @property
    def size(self) -> int:
        return self.offsets["block_tables"][0] + self.seqs * self.width

    def fill(self, host: np.ndarray, step, scratch_slot: int) -> int:
        """Write one step's inputs (StepInputs, unpadded) into host, padding each part to the layout.
        Returns how many leading entries the device needs (through the last real block-table row)."""
        o = self.offsets

        def put(name, values, pad):
            at, n = o[name]
            host[at:at + len(values)] = values
            host[at + len(values):at + n] = pad
        n = len(step.input_ids)
        put("input_ids", step.input_ids, 0)
        put("positions", step.positions, 0)
        put("slots", step.slots, scratch_slot)
        put("sample_rows", step.rows, 0)
        cu = np.cumsum([0, *step.query_lens])
        put("cu_q", cu, n)
        put("seq_lens", step.context_lens, 0)
        at = o["block_tables"][0]
        for i, table in enumerate(step.block_tables):   # columns past a table's end are never read
            host[at + i * self.width:at + i * self.width + len(table)] = table
        return at + len(step.block_tables) * self.width


class StepGraphs:
    """Static buffers and one captured forward per token bucket. capture=False runs the same region
    eagerly on each call (how tests check the buffers and padding on a CPU)."""

    def __init__(self, model, cos, sin, max_tokens: int, max_num_seqs: int, max_blocks: int, scratch_slot: int,
                 capture: bool = True):
        self.model, self.cos, self.sin = model, cos, sin
        self.sizes = token_buckets(max_tokens)
        self.max_num_seqs, self.scratch_slot = max_num_seqs, scratch_slot
        dev = cos.device
        self.layout = StepLayout(self.sizes[-1], min(self.sizes[-1], max_num_seqs), max_blocks)
        self.host = torch.zeros(self.layout.size, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.host_np = self.host.numpy()
        self.flat = torch.zeros(self.layout.size, dtype=torch.long, device=dev)
        self.buf = {name: self.flat[at:at + n] for name, (at, n) in self.layout.offsets.items()}
        self.buf["block_tables"] = self.buf["block_tables"].view(self.layout.seqs, max_blocks)
        # idle values describe an empty step, so every bucket's warm-up starts from valid inputs
        self.buf["slots"].fill_(scratch_slot)
        self.logits = torch.zeros(self.layout.seqs, model.head_weight().shape[0], dtype=cos.dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds, self.memory_bytes = 0.0, 0
        if capture:
            self._capture_all()

    def seqs_for(self, tokens: int) -> int:
        return min(tokens, self.max_num_seqs)

    def bucket(self, num_tokens: int, num_seqs: int) -> int | None:
        return bucket_for(num_tokens, num_seqs, self.sizes, self.max_num_seqs)

    def stats(self) -> dict:
        return {"token_buckets": self.sizes, "max_seqs": self.layout.seqs, "captured": len(self.graphs),
                "capture_seconds": round(self.capture_seconds, 3), "memory_bytes": self.memory_bytes}

    def _forward(self, t: int):
        """The captured region: the model over the first t token rows and S(t) sequences of the buffers."""
        s, b = self.seqs_for(t), self.buf
        set_metadata(AttentionMetadata(slot_mapping=b["slots"][:t], context_lens=b["seq_lens"][:s],
                                       block_tables=b["block_tables"][:s], cu_seqlens_q=b["cu_q"][:s + 1]))
        pos = b["positions"][:t]
        hidden = self.model(b["input_ids"][:t], self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1))
        self.logits[:s] = self.model.compute_logits(hidden[b["sample_rows"][:s]])
        set_metadata(None)

    @torch.inference_mode()
    def _capture_all(self):
        t0, reserved = time.perf_counter(), torch.cuda.memory_reserved()
        pool = None
        with self.model.ops.fusing():         # the graphs hold the fused elementwise kernels
            for t in reversed(self.sizes):    # largest first: the smaller graphs reuse its memory pool
                self._forward(t)              # warm-up: torch.compile and Triton compile, cuBLAS picks kernels
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self._forward(t)
                pool = graph.pool()
                self.graphs[t] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.memory_bytes = torch.cuda.memory_reserved() - reserved
        log.info("captured %d CUDA graphs (token buckets %s, up to %d sequences) in %.1f s, %.0f MiB",
                 len(self.graphs), self.sizes, self.layout.seqs, self.capture_seconds, self.memory_bytes / 2**20)

    def run(self, step, t: int) -> torch.Tensor:
        """One step (StepInputs, unpadded) at bucket t: fill, one copy, replay. Returns the logits of
        the step's sample rows, (len(step.rows), vocab), a view of the static logits."""
        # the pinned buffer is free to refill: the previous step's copy finished before its sampled
        # tokens came back to the host
        used = self.layout.fill(self.host_np, step, self.scratch_slot)
        self.flat[:used].copy_(self.host[:used], non_blocking=True)
        if self.graphs:
            self.graphs[t].replay()
        else:
            self._forward(t)
        return self.logits[:len(step.rows)]
