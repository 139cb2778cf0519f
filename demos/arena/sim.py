"""The arena's two ways to run a policy on a workload: the model-free simulator and the real engine.

SimEngine is the engine without a model: the same Scheduler, BlockManager and policy checks,
the same StepRecords and request events, but each step's time is predicted by the measured
step-cost fit (app/readers/analysis.py: a + b*tokens + c*context) on a simulated clock, so thousands
of steps take seconds. play() feeds a workload to either engine on its own clock and returns
everything it published; both engines are driven by the same loop.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from app.readers.analysis import CostFit, predict
from demos.arena.workloads import FIRST_ID, Job, Workload
from engine.outputs.records import Listeners, RequestEvent, read_batch, step_record
from engine.protocol import StepOutputs
from engine.sampling_params import SamplingParams
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.policies import resolve
from engine.scheduling.policy import Policy
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sequence import Sequence, Status

MAX_IDLE_STEPS = 200        # steps in a row that ran nothing while nobody else could arrive: the policy is stuck


class PolicyStuck(RuntimeError):
    """The policy ran nothing, step after step, while requests waited and no arrival was due."""


class SimEngine:
    """LLMEngine's step loop with the forward pass replaced by the step-cost fit's prediction."""

    def __init__(self, workload: Workload, fit: CostFit, policy: Policy | str = "chunked"):
        self.fit, self.now = fit, 0.0
        self.block_manager = BlockManager(workload.num_kv_blocks, workload.block_size, workload.enable_prefix_caching)
        self.block_manager.set_capacity(workload.max_kv_blocks)
        self.scheduler = Scheduler(self.block_manager, resolve(policy), workload.token_budget, workload.max_num_seqs)
        self.requests: dict[str, Sequence] = {}
        self.done: dict[str, Sequence] = {}
        self.listeners = Listeners()
        self.step_index = 0
        self.device = f"sim/{fit.device or 'fit'}"

    def clock(self) -> float:
        return self.now

    def subscribe(self, fn):
        self.listeners.subscribe(fn)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, label: str) -> str:
        rid = f"r{len(self.requests) + len(self.done)}"
        seq = Sequence(rid, label, list(prompt_token_ids), params, self.now)
        self.requests[rid] = seq
        self.scheduler.add(seq)
        self._emit(seq, "arrived", prompt_len=seq.prompt_len, max_tokens=params.max_tokens)
        return rid

    def _emit(self, seq: Sequence, event: str, **extra):
        self.listeners.emit(RequestEvent(event, seq.id, seq.label, self.now, **extra))

    def step(self) -> StepOutputs | None:
        if not self.scheduler.has_work():
            return None
        t_start = self.now
        batch = self.scheduler.schedule(self.now)
        before = read_batch(batch, self.scheduler.running)
        for seq in batch.preempted:
            self._emit(seq, "preempted", step=self.step_index)
        context = sum(it.start + it.tokens for it in before[0])
        if batch.items:
            self.now += max(0.0, predict(self.fit, batch.num_tokens, context))
        # any token will do: only a preempted request's own blocks could ever be matched by it
        sampled = [FIRST_ID + s.num_tokens % 997 for s, n in batch.items if s.num_computed_tokens + n == s.num_tokens]
        finished = []
        for seq, _ in self.scheduler.update(batch, sampled, self.now):
            if seq.num_output_tokens == 1:
                self._emit(seq, "first_token", ttft=self.now - seq.arrival_time)
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.scheduler.remove(seq)
                seq.status, seq.finish_reason, seq.finish_time = Status.FINISHED, "length", self.now
                self.done[seq.id] = self.requests.pop(seq.id)
                finished.append(seq.id)
                self._emit(seq, "finished", finish_reason="length", output_tokens=seq.num_output_tokens)
        record = step_record(self.step_index, self.scheduler, batch, before, finished, None,
                             (t_start, t_start, t_start, self.now), self.clock, self.device)
        self.step_index += 1
        self.listeners.emit(record)
        return StepOutputs(record.to_dict())      # no text: the simulator samples no tokens


@dataclass
class Played:
    """One policy's run of a workload: what the engine published, and which job each request was."""
    stream: list[dict] = field(default_factory=list)
    jobs: dict[str, Job] = field(default_factory=dict)      # request id -> its job
    due: dict[str, float] = field(default_factory=dict)     # request id -> when it was due (engine clock)
    wall_s: float = 0.0


def play(engine, workload: Workload, tau: float, sleep=None) -> Played:
    """Feed the workload's jobs to `engine` as their times come (τ units times `tau` seconds, on the
    engine's clock) and step it until every request has finished. `sleep(seconds)` waits for the next
    arrival on a real engine; the simulator's clock jumps there instead."""
    run, wall0 = Played(), time.perf_counter()
    engine.subscribe(run.stream.append)
    pending = deque(workload.jobs)
    t0, idle = engine.clock(), 0
    while pending or engine.has_unfinished():
        now = engine.clock() - t0
        while pending and pending[0].at * tau <= now:
            job = pending.popleft()
            rid = engine.add_request(prompt_token_ids=list(job.prompt), label=job.label,
                                     params=SamplingParams(max_tokens=job.max_tokens, ignore_eos=True))
            engine.scheduler.slo_classes[rid] = job.slo
            run.jobs[rid], run.due[rid] = job, t0 + job.at * tau
        out = engine.step() if engine.has_unfinished() else None
        record = out.record if out is not None else None
        idle = idle + 1 if record is None or not record["items"] else 0
        if idle and pending:                                    # nothing ran: on to the next arrival
            wait = t0 + pending[0].at * tau - engine.clock()
            if sleep is not None:
                sleep(max(0.0, wait))
            else:
                engine.now += max(0.0, wait)
        elif idle > MAX_IDLE_STEPS:
            raise PolicyStuck(f"policy {engine.scheduler.policy!r} ran nothing for {idle} steps in a row while "
                              f"{len(engine.scheduler.waiting)} requests waited and "
                              f"{len(engine.scheduler.running)} ran")
    run.wall_s = time.perf_counter() - wall0
    return run


def real_engine(workload: Workload, engine_kwargs: dict):
    """An LLMEngine with the workload's budgets and KV cache (the simulator's: its size, prefix caching and
    cap), warmed up. No speculative decoding: the simulator cannot draft, so neither does this engine."""
    from app.replay.play import warm_up
    from engine import EngineConfig, LLMEngine
    config = EngineConfig(**{"dtype": "float32", **engine_kwargs, "policy": "chunked",
                             "max_num_batched_tokens": workload.token_budget, "max_num_seqs": workload.max_num_seqs,
                             "num_kv_blocks": workload.num_kv_blocks, "block_size": workload.block_size,
                             "enable_prefix_caching": workload.enable_prefix_caching, "speculative_config": None})
    engine = LLMEngine(config)
    warm_up(engine, max(len(j.prompt) for j in workload.jobs))
    if workload.max_kv_blocks is not None:          # after the warm-up, whose prompt may not fit under the cap
        engine.set_policy(max_kv_blocks=workload.max_kv_blocks)
    return engine


def play_real(workload: Workload, tau: float, policy: Policy | str, fit: CostFit, engine_kwargs: dict) -> Played:
    """One policy on a fresh, warmed-up real engine (a cold prefix cache, like the simulator's)."""
    engine = real_engine(workload, engine_kwargs)
    engine.set_policy(policy)
    engine.scheduler.cost_fit = fit
    return play(engine, workload, tau, sleep=time.sleep)
