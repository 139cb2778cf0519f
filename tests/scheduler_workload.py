"""A random scheduler workload (Case), driven step by step with every invariant checked after each
schedule(): the scheduler property test (tests/test_scheduler_properties.py) runs thousands of them, and
the KV-map test of app/readers/analysis.py extends one (tests/test_analysis.py)."""
import math
import random

from engine.sampling_params import SamplingParams
from engine.scheduling.block_manager import BlockManager
from engine.scheduling.policies import resolve
from engine.scheduling.scheduler import Batch, Scheduler
from engine.scheduling.sequence import Sequence, Status

POLICIES = ("static", "continuous", "chunked")
MAX_STEPS = 3000


class Case:
    def __init__(self, seed: int):
        rng = self.rng = random.Random(seed)
        self.bs = rng.choice([1, 1, 2, 2, 3, 4, 8, 16, rng.randint(1, 16)])
        bases = [[rng.randrange(6) for _ in range(rng.randint(0, 3 * self.bs))] for _ in range(3)]
        self.requests = []
        for i in range(rng.randint(2, 12)):
            prompt = rng.choice(bases) + [rng.randrange(6) for _ in range(rng.randint(1, 3 * self.bs + 4))]
            self.requests.append((f"r{i}", prompt, rng.randint(1, 6)))
        longest = max(len(p) + m for _, p, m in self.requests)
        # the engine's promise: any one request fits in the cache on its own
        need = -(-longest // self.bs)
        self.sched = Scheduler(BlockManager(need + rng.choice([0, 1, 3, need // 2, need, 2 * need]), self.bs),
                               resolve(rng.choice(POLICIES)), *self.budgets())
        self.seqs: dict[str, Sequence] = {}
        self.admitted = 0                  # admission counter: running order is admission order
        self.order: dict[str, int] = {}
        self.hits = 0                      # prefix-cache hit tokens of admissions that held
        self.left_out: dict[str, int] = {}  # chunked: steps in a row a ready decode was left out
        self.peak_running = 0
        self.static_formed = False   # the running batch was formed under static (not inherited by a switch)

    def budgets(self):
        rng = self.rng
        return (rng.choice([1, 2, 3, 5, 8, 16, 64]), rng.choice([1, 2, 3, 4, 8]),
                rng.choice([None, 1, 2, 3, 5]))

    # ---- what a step does around schedule() ----
    def drive(self):
        rng, sched = self.rng, self.sched
        pending = list(self.requests)
        for step in range(MAX_STEPS):
            if not pending and not sched.has_work():
                return step
            if pending and rng.random() < 0.5:
                rid, prompt, m = pending.pop(0)
                s = Sequence(rid, rid, list(prompt), SamplingParams(max_tokens=m), 0.0)
                self.seqs[rid] = s
                sched.add(s)
            live = rng.random() < 0.03 and [s for s in self.seqs.values() if not s.is_finished]
            if live:
                victim = rng.choice(live)
                sched.remove(victim)
                victim.status = Status.ABORTED
            if rng.random() < 0.04:
                sched.set_policy(resolve(rng.choice(POLICIES)), *self.budgets())
                self.left_out.clear()
                self.peak_running = 0
                self.static_formed = False
            self.vary(step)
            before = {"running": list(sched.running), "waiting": list(sched.waiting)}
            batch = sched.schedule()
            self.check(batch, before, step)
            self.apply(batch)
        raise AssertionError(f"not finished after {MAX_STEPS} steps: {self.state()}")

    def vary(self, step: int):
        """A change between steps beyond arrivals, aborts and policy switches (none here; a subclass's)."""

    def apply(self, batch: Batch):
        """The forward pass's outcome (a token is a function of the sequence so far), then the bookkeeping."""
        tokens = [sum(s.all_token_ids) % 6 for s, n in batch.items if s.num_computed_tokens + n == s.num_tokens]
        for s, _ in self.sched.update(batch, tokens, 0.0):
            if s.num_output_tokens >= s.params.max_tokens:
                self.sched.remove(s)
                s.status = Status.FINISHED

    # ---- the invariants ----
    def check(self, batch: Batch, before: dict, step: int):
        sched, bm = self.sched, self.sched.bm
        where = f"step {step}, {sched.policy} budget={sched.token_budget} seqs={sched.max_num_seqs} " \
                f"chunk={sched.max_prefill_chunk} bs={self.bs}: {self.plan(batch)}"
        kinds = ["decode" if s.is_prefill_done else "prefill" for s, _ in batch.items]
        assert kinds == sorted(kinds), f"decodes must precede prefills; {where}"
        assert len(batch.items) <= sched.max_num_seqs, where
        assert len({id(s) for s, _ in batch.items}) == len(batch.items), f"a sequence twice; {where}"
        prefills = kinds.count("prefill")
        if sched.policy == "chunked":
            assert batch.num_tokens <= sched.token_budget, where
        else:   # whole prompts: only a lone prompt may pass the budget
            assert batch.num_tokens <= sched.token_budget or (prefills == 1 == len(kinds)), where
        if sched.policy == "continuous" and prefills:
            assert "decode" not in kinds, f"continuous: a decode in a prefill step; {where}"
        for s, n in batch.items:
            assert s.status == Status.RUNNING and s in sched.running, where
            assert 1 <= n <= s.num_uncomputed_tokens, where
            if s.is_prefill_done:
                assert n == 1, where
            elif sched.policy != "chunked":
                assert n == s.num_uncomputed_tokens, f"whole prompts only; {where}"
            elif sched.max_prefill_chunk:
                assert n <= sched.max_prefill_chunk, where
            assert len(s.block_table) * self.bs >= s.num_computed_tokens + n, f"no room for the tokens; {where}"
        newcomers = [s for s in sched.running if s not in before["running"]]
        if sched.policy == "static" and before["running"]:
            assert not newcomers, f"static admitted into a running batch; {where}"
        self.check_static_prefill(batch, before, prefills, where)
        for s in newcomers:
            self.order[s.id] = self.admitted
            self.admitted += 1
            self.hits += s.num_cached_tokens
        assert bm.num_hit_tokens == self.hits, "prefix hits counted for admissions that were undone"
        self.check_preemption(batch, newcomers, where)
        self.check_fairness(batch, where)
        self.check_stall_causes(batch, where)
        self.check_blocks(where)

    def check_static_prefill(self, batch: Batch, before: dict, prefills: int, where: str):
        """Static: a batch formed under static prefills all its members in one step, so no member that
        already has its first token waits for another member's prompt (a re-admitted one may)."""
        sched = self.sched
        if sched.policy != "static":
            return
        if not before["running"] and sched.running:
            self.static_formed = True
        if self.static_formed and prefills:
            waiting_members = [s.id for s in sched.running if s.is_prefill_done and not s.num_preemptions]
            assert not waiting_members, f"static: {waiting_members} wait for a member's prompt; {where}"

    def check_preemption(self, batch: Batch, newcomers: list, where: str):
        if not batch.preempted:
            return
        assert not newcomers, f"a step that preempted admitted someone new; {where}"
        newest_victim = min(self.order[s.id] for s in batch.preempted)
        kept = [s.id for s in self.sched.running if self.order[s.id] > newest_victim]
        assert not kept, f"preempted {[s.id for s in batch.preempted]} but kept newer {kept}; {where}"
        for s in batch.preempted:
            assert s.status == Status.WAITING and s not in self.sched.running, where

    def check_stall_causes(self, batch: Batch, where: str):
        """Every running decode left out has its cause, decided by the scheduler, and the cause is true."""
        sched = self.sched
        for s in sched.running:
            if not s.is_prefill_done or s in batch:
                continue
            assert s.id in batch.left_out, f"{s.id} left out without a cause; {where}"
            cause, by, n = batch.left_out[s.id]
            if cause in ("prefill", "static_batch"):
                assert cause == ("prefill" if sched.policy == "continuous" else "static_batch"), where
                assert any(x.id == by and m == n and not x.is_prefill_done for x, m in batch.items), where
            elif cause == "no_slot":
                assert len(batch.items) >= sched.max_num_seqs or batch.preempted, where
            else:
                assert cause == "budget", where

    def check_fairness(self, batch: Batch, where: str):
        """Chunked: every ready decode gets its token at least every ceil(running / slots) steps."""
        sched = self.sched
        if sched.policy != "chunked":
            self.left_out.clear()
            return
        ready = [s for s in sched.running if s.is_prefill_done]
        in_batch = {id(s) for s, _ in batch.items}
        decodes = sum(1 for s, _ in batch.items if s.is_prefill_done)
        slots = min(sched.token_budget, sched.max_num_seqs)
        if any(id(s) not in in_batch for s in ready):
            assert decodes >= slots, f"a decode left out while the budget allowed it; {where}"
        self.peak_running = max(self.peak_running, len(sched.running))
        bound = math.ceil(self.peak_running / slots)
        for s in ready:
            self.left_out[s.id] = 0 if id(s) in in_batch else self.left_out.get(s.id, 0) + 1
            assert self.left_out[s.id] < bound, f"{s.id} left out {self.left_out[s.id]} steps in a row; {where}"

    def check_blocks(self, where: str):
        bm, sched = self.sched.bm, self.sched
        holders = {}
        for s in sched.running:
            assert len(set(s.block_table)) == len(s.block_table), where
            for b in s.block_table:
                holders[b] = holders.get(b, 0) + 1
        for s in sched.waiting:
            assert not s.block_table and s.num_computed_tokens == 0, f"waiting {s.id} holds blocks; {where}"
        for block in bm.blocks:
            assert block.ref_count == holders.get(block.id, 0), f"block {block.id} refcount; {where}"
            assert (block.id in bm.free_ids) == (block.ref_count == 0), where

    def plan(self, batch: Batch) -> list:
        return [(s.id, n) for s, n in batch.items] + [("preempted", [s.id for s in batch.preempted])]

    def state(self) -> dict:
        return {s.id: (s.status.value, s.num_computed_tokens, s.num_tokens) for s in self.seqs.values()}
