"""Property-based tests of the scheduler + block manager under random arrivals, finishes
and aborts (no model).

``Simulation`` runs the engine's loop on fake sequences: ``schedule()``, a pretend model
step that writes the scheduled tokens into a model of the KV cache, ``update_after_step``,
then every sequence that caught up samples a token from a deterministic "greedy model" and
finishes once it has ``max_tokens`` of them. After every step it checks the budget, the
per-sequence token counts, ``max_num_seqs``, block ownership and ref counts, queue states,
and that every scheduled sequence attends to KV that really holds its own tokens (so a
wrong prefix hit or a block reused while in use would be caught). At the end every request
must have finished within a bound of steps and every block must be free (possibly cached).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, currently_in_test_context, given, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st

from cb_serve.engine.block_manager import BlockManager
from cb_serve.engine.request_queue import PriorityQueue
from cb_serve.engine.scheduler import Scheduler
from cb_serve.sampling_params import SamplingParams
from cb_serve.sequence import SchedulerOutput, Sequence, SequenceStatus

ALPHABET = 3
MAX_STEPS = 10_000


def event(name: str) -> None:
    """``hypothesis.event``, also usable from the deterministic tests."""
    if currently_in_test_context():
        hypothesis_event(name)


def next_token(token_ids: list[int]) -> int:
    """Deterministic "greedy model": equal histories continue equally (more cache hits)."""
    return (token_ids[-1] * 2 + len(token_ids)) % ALPHABET


@dataclass
class Request:
    arrival_step: int
    prompt: list[int]
    max_tokens: int
    priority: int = 0  # scheduling_policy "priority": lower first


@dataclass
class Workload:
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    extra_blocks: int
    requests: list[Request]
    aborts: list[tuple[int, int]] = field(default_factory=list)  # (step, which unfinished seq)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    policy: str = "fcfs"

    @property
    def max_len(self) -> int:
        return max(len(r.prompt) + r.max_tokens for r in self.requests)

    @property
    def num_blocks(self) -> int:
        """Enough for one sequence of the maximum length, plus ``extra_blocks``."""
        return -(-self.max_len // self.block_size) + self.extra_blocks


class Simulation:
    def __init__(self, w: Workload) -> None:
        self.w = w
        self.bm = BlockManager(w.num_blocks, w.block_size, w.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.bm, w.max_num_batched_tokens, w.max_num_seqs, w.max_len, w.enable_chunked_prefill, policy=w.policy
        )
        self.kv: list[list[int | None]] = [[None] * w.block_size for _ in range(w.num_blocks)]
        self.seqs: list[Sequence] = []
        self.pending = sorted(enumerate(w.requests), key=lambda item: item[1].arrival_step)
        self.aborts = sorted(w.aborts)
        self.step_no = 0
        self.outputs: list[SchedulerOutput] = []

    # ---- the loop ---------------------------------------------------------------------
    def add(self, index: int, request: Request) -> Sequence:
        seq_id = f"r{index}"
        params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens)
        arrival = float(len(self.seqs))  # arrival order, without ties
        seq = Sequence(
            seq_id, seq_id, 0, request.prompt, params, request.max_tokens, arrival, priority=request.priority
        )
        self.seqs.append(seq)
        self.scheduler.add(seq)
        return seq

    def unfinished(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    def arrive_and_abort(self) -> None:
        while self.pending and self.pending[0][1].arrival_step <= self.step_no:
            self.add(*self.pending.pop(0))
        while self.aborts and self.aborts[0][0] <= self.step_no:
            _, pick = self.aborts.pop(0)
            live = self.unfinished()
            if live:
                seq = live[pick % len(live)]
                event(f"abort a {seq.status.name} sequence")
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                self.check_state()

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.outputs.append(out)
        self.check_output(out)
        self.check_state()
        self.compute(out)
        self.scheduler.update_after_step(out)
        for seq in out.seqs:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(next_token(seq.token_ids), float(self.step_no))
                if seq.num_output_tokens >= seq.max_tokens:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
        self.check_state()
        self.step_no += 1
        return out

    def run(self) -> None:
        while self.pending or (self.scheduler.waiting or self.scheduler.running):
            assert self.step_no < MAX_STEPS, f"not done after {MAX_STEPS} steps: {self.unfinished()}"
            self.arrive_and_abort()
            if not (self.scheduler.waiting or self.scheduler.running):  # idle until the next arrival
                self.step_no += 1
                continue
            out = self.step()
            assert not out.is_empty, f"step {self.step_no - 1} scheduled nothing: {self.unfinished()}"
        self.check_done()

    def compute(self, out: SchedulerOutput) -> None:
        """The model step: writes the KV of the scheduled tokens into their blocks."""
        bs = self.bm.block_size
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block_id = seq.block_table[pos // bs]
                assert self.bm.ref_count(block_id) == 1, f"{seq} writes block {block_id}, which is shared"
                assert self.bm.block_hash(block_id) is None, f"{seq} writes cached block {block_id}"
                self.kv[block_id][pos % bs] = seq.token_ids[pos]

    # ---- checks -----------------------------------------------------------------------
    def check_output(self, out: SchedulerOutput) -> None:
        s = self.scheduler
        bs = self.bm.block_size
        assert len(out.seqs) == len(out.num_scheduled_tokens)
        assert out.total_tokens <= s.max_num_batched_tokens, "token budget exceeded"
        assert len({id(seq) for seq in out.seqs}) == len(out.seqs), "a sequence scheduled twice"
        assert not {id(seq) for seq in out.seqs} & {id(seq) for seq in out.preempted}
        running = {id(seq) for seq in s.running}
        for seq, n in zip(out.seqs, out.num_scheduled_tokens):
            assert 1 <= n <= seq.num_uncomputed_tokens, (seq, n)
            if not s.enable_chunked_prefill:
                assert n == seq.num_uncomputed_tokens, "a prompt was chunked with chunked prefill disabled"
            assert id(seq) in running and seq.status == SequenceStatus.RUNNING
            assert len(seq.block_table) * bs >= seq.num_computed_tokens + n, "no KV slots for the scheduled tokens"
            for pos in range(seq.num_computed_tokens):  # its context is its own tokens' KV
                assert self.kv[seq.block_table[pos // bs]][pos % bs] == seq.token_ids[pos], (seq, pos)
        for seq in out.preempted:
            assert seq.status == SequenceStatus.WAITING and seq.block_table == [] and seq.num_computed_tokens == 0
        if s.policy == "priority":
            check_priority_order(s, out)
        if out.preempted:
            event("preemption")
        elif out.total_tokens < s.max_num_batched_tokens:
            # budget left over: every running sequence got all it could use
            scheduled = dict(zip(map(id, out.seqs), out.num_scheduled_tokens))
            for seq in s.running:
                assert scheduled.get(id(seq)) == seq.num_uncomputed_tokens, f"{seq} starved with budget left"
        decode = sum(1 for n in out.num_scheduled_tokens if n == 1)
        if decode and decode < len(out.seqs):
            event("step mixes decodes and prefill chunks")

    def check_state(self) -> None:
        s = self.scheduler
        bm = self.bm
        assert len(s.running) <= s.max_num_seqs
        assert all(seq.status == SequenceStatus.RUNNING for seq in s.running)
        assert all(seq.status == SequenceStatus.WAITING for seq in s.waiting)
        in_queues = [id(seq) for seq in [*s.running, *s.waiting]]
        assert len(set(in_queues)) == len(in_queues), "a sequence queued twice"
        assert set(in_queues) == {id(seq) for seq in self.unfinished()}, "a live sequence lost, or a finished one kept"
        for seq in s.waiting:
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        if s.policy == "priority":
            keys = [key(seq) for seq in s.waiting]
            assert keys == sorted(keys), "the waiting queue is out of (priority, arrival) order"
        for seq in self.seqs:
            if seq.is_finished:
                assert seq.block_table == []
        check_block_ownership(bm, s.running)
        bm.check_invariants([*s.running, *s.waiting])
        assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
        for h, block_id in bm.cached.items():
            assert bm.block_hash(block_id) == h
            assert tuple(self.kv[block_id]) == bm.block_tokens(block_id), f"cached block {block_id} lost its KV"

    def check_done(self) -> None:
        assert not self.scheduler.running and not self.scheduler.waiting
        for seq in self.seqs:
            assert seq.is_finished, seq
            if seq.status == SequenceStatus.FINISHED_LENGTH:
                assert seq.num_output_tokens == seq.max_tokens
        assert len(self.seqs) == len(self.w.requests), "a request never arrived"
        assert self.bm.num_used_blocks == 0, "blocks leaked"
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(self.bm.block_hash(b) is not None for b in self.bm.cached.values())
        self.bm.check_invariants([])
        assert self.bm.block_hashes == {} and self.bm.num_registered == {}, "per-sequence state leaked"


def key(seq: Sequence) -> tuple[int, float]:
    """Priority scheduling's order: lower first (every simulated arrival time is distinct)."""
    return seq.priority, seq.times.arrival


def check_priority_order(s: Scheduler, out: SchedulerOutput) -> None:
    """Under priority scheduling the step admitted a head of the (priority, arrival) order, and
    every victim of a preemption came after every sequence still running, in that order."""
    admitted = [key(seq) for seq in out.seqs[len(out.seqs) - out.num_admitted :]]
    assert admitted == sorted(admitted), "admitted out of (priority, arrival) order"
    if admitted and s.waiting:
        assert admitted[-1] < min(key(seq) for seq in s.waiting), "a waiting sequence was overtaken"
    if out.preempted and s.running:
        assert min(map(key, out.preempted)) > max(map(key, s.running)), "preempted ahead of a lower priority"
        event("priority preemption")


def check_block_ownership(bm: BlockManager, seqs: Iterable[Sequence]) -> None:
    """No block in two tables unless it is a cached (hashed) block whose ref count is its
    number of owners; never twice in one table."""
    owners: dict[int, int] = {}
    for seq in seqs:
        assert len(set(seq.block_table)) == len(seq.block_table), f"a block twice in {seq}"
        for block_id in seq.block_table:
            owners[block_id] = owners.get(block_id, 0) + 1
    for block_id, n in owners.items():
        assert bm.ref_count(block_id) == n, (block_id, bm.ref_count(block_id), n)
        if n > 1:
            assert bm.block_hash(block_id) is not None, f"block {block_id} owned by {n} sequences but not cached"
    assert bm.num_used_blocks == len(owners)


# ---- strategies ---------------------------------------------------------------------------
token_lists = st.lists(st.integers(0, ALPHABET - 1), max_size=20)


@st.composite
def workloads(draw: st.DrawFn, chunked: bool = True, policy: str = "fcfs") -> Workload:
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    prefixes = draw(st.lists(token_lists, min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        prompt = draw(st.sampled_from(prefixes)) + draw(token_lists)
        request = Request(draw(st.integers(0, 15)), prompt or [0], draw(st.integers(1, 12)))
        if policy == "priority":
            request.priority = draw(st.integers(-2, 2))
        requests.append(request)
    max_len = max(len(r.prompt) + r.max_tokens for r in requests)
    if chunked:
        budget = draw(st.integers(1, 48))
    else:  # without chunking a whole (re)computed sequence must fit: budget >= max_model_len
        budget = draw(st.integers(max_len, max_len + 16))
    return Workload(
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 6)),
        extra_blocks=draw(st.integers(0, 2) | st.integers(0, 12)),  # often just one sequence's worth
        requests=requests,
        aborts=draw(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 100)), max_size=3)),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()) if chunked else True,
        policy=policy,
    )


# Share of the examples that must reach each path: a strategy change that stops reaching one fails.
MIN_REACHED = {"preemption": 0.1, "prefix-cache hit": 0.1, "chunked prefill": 0.2, "eviction": 0.05, "abort": 0.1}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workload_invariants_and_liveness(policy: str) -> None:
    reached: Counter[str] = Counter()

    @settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
    @given(workloads(policy=policy))
    def run(w: Workload) -> None:
        sim = Simulation(w)
        sim.run()
        c = sim.scheduler.counters
        paths = {
            "preemption": c.num_preemptions > 0,
            "prefix-cache hit": c.prefix_cache_hits > 0,
            "chunked prefill": c.num_partial_prefills > 0,
            "eviction": sim.bm.num_evictions > 0,
            "abort": any(s.status == SequenceStatus.FINISHED_ABORTED for s in sim.seqs),
        }
        reached.update(["example", *(name for name, hit in paths.items() if hit)])
        for name, hit in paths.items():
            if hit:
                event(f"workload with {name}")
        assert c.prefix_cache_hits <= c.prefix_cache_queries
        if not w.enable_prefix_caching:
            assert c.prefix_cache_hits == 0

    run()
    shares = {name: reached[name] / reached["example"] for name in MIN_REACHED}
    print("share of examples reaching each path:", {k: round(v, 2) for k, v in shares.items()})
    for name, least in MIN_REACHED.items():
        assert shares[name] >= least, f"only {shares[name]:.0%} of the examples reached {name} (want >= {least:.0%})"


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workload_without_chunked_prefill(policy: str) -> None:
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(workloads(chunked=False, policy=policy))
    def run(w: Workload) -> None:
        Simulation(w).run()

    run()


# ---- deterministic examples ---------------------------------------------------------------
def test_decode_and_chunked_prefill_share_a_step() -> None:
    w = Workload(block_size=4, max_num_batched_tokens=8, max_num_seqs=4, extra_blocks=8, requests=[])
    w.requests = [Request(0, [0, 1, 2], 20), Request(1, [(i * 7) % ALPHABET for i in range(30)], 2)]
    sim = Simulation(w)
    sim.arrive_and_abort()
    out = sim.step()
    a = sim.seqs[0]
    assert out.seqs == [a] and out.num_scheduled_tokens == [3] and a.num_output_tokens == 1

    chunks: list[int] = []
    while True:
        sim.arrive_and_abort()
        b = sim.seqs[1]
        out = sim.step()
        assert out.total_tokens <= 8
        assert out.seqs[0] is a and out.num_scheduled_tokens[0] == 1, "the decode goes first, one token"
        if b.num_output_tokens:
            chunks.append(out.num_scheduled_tokens[1])
            break
        assert out.seqs == [a, b]
        chunks.append(out.num_scheduled_tokens[1])
    assert chunks == [7, 7, 7, 7, 2]  # 30 prompt tokens, chunked over five steps under the budget
    assert sim.scheduler.counters.num_partial_prefills == 4, "4 chunks short of the prompt; decodes are not"
    assert sim.scheduler.counters.num_preemptions == 0
    first_scheduled = [s.times.first_scheduled for s in sim.seqs]
    assert None not in first_scheduled
    sim.run()
    assert [s.times.first_scheduled for s in sim.seqs] == first_scheduled, "set once, at the first scheduling"
    assert all(s.times.finished is not None and s.times.finished >= s.times.first_scheduled for s in sim.seqs)


def test_a_prompt_that_fills_the_budget_exactly_is_not_chunked() -> None:
    w = Workload(block_size=4, max_num_batched_tokens=8, max_num_seqs=2, extra_blocks=4, requests=[])
    w.requests = [Request(0, [i % ALPHABET for i in range(8)], 2)]
    sim = Simulation(w)
    sim.arrive_and_abort()
    assert sim.step().num_scheduled_tokens == [8]
    assert sim.scheduler.counters.num_partial_prefills == 0


def test_every_partial_prefill_and_preemption_is_counted() -> None:
    # two 6-token prompts under a budget of 4: each is admitted with a partial first chunk
    w = Workload(block_size=2, max_num_batched_tokens=4, max_num_seqs=2, extra_blocks=8, requests=[])
    w.requests = [Request(0, [0, 1, 2, 0, 1, 2], 1), Request(0, [2, 1, 0, 2, 1, 0], 1)]
    sim = Simulation(w)
    sim.run()
    assert sim.scheduler.counters.num_partial_prefills == 2
    # three sequences in a cache that holds one grown sequence: the newest is preempted twice
    w = Workload(block_size=1, max_num_batched_tokens=16, max_num_seqs=4, extra_blocks=0, requests=[])
    w.requests = [Request(0, [0, 1, 2, 0], 7), Request(0, [2, 2, 1, 0, 1], 7), Request(0, [1, 1, 2], 7)]
    sim = Simulation(w)
    sim.run()
    assert [s.num_preemptions for s in sim.seqs] == [0, 1, 2]
    assert sim.scheduler.counters.num_preemptions == 3 == sum(len(out.preempted) for out in sim.outputs)


def test_chunked_prefill_is_the_default() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(bm, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=64)
    seq = Sequence("s", "s", 0, list(range(20)), SamplingParams(max_tokens=4), 4)
    scheduler.add(seq)
    assert scheduler.schedule().num_scheduled_tokens == [8]
    assert scheduler.counters.num_partial_prefills == 1


def test_preemption_recomputes_and_everyone_finishes() -> None:
    # two sequences growing to 16 tokens (8 blocks of 2 each) in 10 blocks: together they cannot fit
    w = Workload(
        block_size=2,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        extra_blocks=2,
        requests=[Request(0, [0, 1, 2, 0], 12), Request(0, [2, 2, 1, 0, 1], 11)],
    )
    sim = Simulation(w)
    sim.run()
    victim = sim.seqs[1]
    events = sum(out.preempted == [victim] for out in sim.outputs)
    assert events > 0 and sum(len(out.preempted) for out in sim.outputs) == events
    assert sim.scheduler.counters.num_preemptions == victim.num_preemptions == events, "one count per preemption"
    assert sim.seqs[0].num_preemptions == 0, "the newest sequence is preempted"
    assert any(out.preempted == [victim] for out in sim.outputs)
    # re-admitted, its computed full blocks that were not evicted meanwhile come back as a prefix-cache hit
    assert sim.scheduler.counters.prefix_cache_hits > 0
    assert victim.num_cached_tokens == 0, "num_cached_tokens counts only the first admission's hit"
    assert all(seq.num_output_tokens == seq.max_tokens for seq in sim.seqs)


def test_shared_prefix_hits_the_cache() -> None:
    prefix = [0, 1, 2, 0, 1, 2, 0, 1]  # two full blocks of 4
    w = Workload(
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        extra_blocks=8,
        requests=[Request(0, prefix + [2], 3), Request(5, prefix + [1, 1, 1], 3), Request(5, prefix, 3)],
    )
    sim = Simulation(w)
    sim.run()
    c = sim.scheduler.counters
    assert c.prefix_cache_queries == 9 + 11 + 8
    # the second prompt hits both blocks; the third must recompute its last token, so 1 block
    assert c.prefix_cache_hits == 8 + 4
    assert [seq.num_cached_tokens for seq in sim.seqs] == [0, 8, 4]


def test_aborts_of_waiting_and_running_sequences_free_everything() -> None:
    w = Workload(
        block_size=2,
        max_num_batched_tokens=4,
        max_num_seqs=1,
        extra_blocks=0,
        requests=[Request(0, [0, 1, 2, 0, 1, 2], 5), Request(0, [1, 1], 5), Request(0, [2], 5)],
    )
    sim = Simulation(w)
    sim.arrive_and_abort()
    sim.step()
    a, b, c = sim.seqs
    assert a.status == SequenceStatus.RUNNING and b.status == c.status == SequenceStatus.WAITING
    sim.scheduler.finish(b, SequenceStatus.FINISHED_ABORTED)  # waiting
    sim.scheduler.finish(a, SequenceStatus.FINISHED_ABORTED)  # running, mid-prefill
    sim.check_state()
    assert sim.bm.num_used_blocks == 0
    sim.run()
    assert c.status == SequenceStatus.FINISHED_LENGTH
    assert [a.status, b.status] == [SequenceStatus.FINISHED_ABORTED] * 2


NON_CHUNKED_STARVATION = {
    # a prompt longer than the budget: never admitted, and it blocks the FCFS queue
    "prompt_longer_than_budget": Workload(
        block_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=2,
        extra_blocks=0,
        requests=[Request(0, [0] * 10, 2), Request(0, [1, 2], 2)],
        enable_chunked_prefill=False,
    ),
    # every prompt fits the budget, but r1 is preempted at 3 tokens (prompt + 2 outputs) and
    # recomputing it needs 3 > 2 tokens in one step: from step 3 on nothing is ever scheduled
    "preempted_sequence_outgrows_budget": Workload(
        block_size=1,
        max_num_batched_tokens=2,
        max_num_seqs=2,
        extra_blocks=0,
        requests=[Request(0, [0], 3), Request(0, [0], 3), Request(1, [0], 1)],
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
    ),
}


@pytest.mark.parametrize("name", sorted(NON_CHUNKED_STARVATION))
def test_without_chunked_prefill_a_starving_config_is_rejected(name: str) -> None:
    w = NON_CHUNKED_STARVATION[name]
    assert w.max_num_batched_tokens < w.max_len
    with pytest.raises(ValueError, match="Without chunked prefill, max_num_batched_tokens"):
        Simulation(w)  # rejected up front: such a configuration could starve


# ---- scheduling_policy "priority" ------------------------------------------------------------
def admission_order(sim: Simulation) -> list[str]:
    """Request ids in the order the steps admitted them (a re-admission after preemption too)."""
    return [seq.request_id for out in sim.outputs for seq in out.seqs[len(out.seqs) - out.num_admitted :]]


@pytest.mark.parametrize("policy, order", [("fcfs", ["r0", "r1", "r2", "r3"]), ("priority", ["r1", "r3", "r2", "r0"])])
def test_admission_order_by_priority_then_arrival(policy: str, order: list[str]) -> None:
    # one running slot: the four run one after another, in the policy's order (fcfs ignores priorities)
    w = Workload(block_size=2, max_num_batched_tokens=16, max_num_seqs=1, extra_blocks=8, requests=[], policy=policy)
    w.requests = [Request(0, [0, 1], 2, priority=p) for p in (2, 0, 1, 0)]
    sim = Simulation(w)
    sim.run()
    assert admission_order(sim) == order
    assert sim.scheduler.counters.num_preemptions == 0


def shortage(policy: str) -> Simulation:
    """r0 (the lowest priority) runs from step 0, r1 and r2 join at step 1, and at step 2 the cache
    is one block short of their next decodes; r3 (priority 0) arrives just before step 2."""
    w = Workload(block_size=1, max_num_batched_tokens=16, max_num_seqs=4, extra_blocks=0, requests=[], policy=policy)
    w.requests = [
        Request(0, [0, 1, 2, 0], 7, priority=1),
        Request(1, [2, 2, 1], 7),
        Request(1, [1, 0], 7),
        Request(2, [2, 0, 0], 1),
    ]
    assert w.num_blocks == 11  # 5 + 3 + 2 blocks after step 1, and each needs one more at step 2
    sim = Simulation(w)
    for _ in range(3):
        sim.arrive_and_abort()
        sim.step()
    return sim


def test_kv_shortage_preempts_the_lowest_priority_even_if_already_scheduled() -> None:
    sim = shortage("priority")
    r0, r1, r2, r3 = sim.seqs
    out = sim.outputs[2]
    # r1's block was missing: r0 (lowest priority), already scheduled this step, is preempted (not the
    # newest, r2) and leaves the step's output
    assert out.preempted == [r0] and out.seqs == [r1, r2] and out.num_scheduled_tokens == [1, 1]
    assert sim.scheduler.running == [r1, r2]
    # back into (priority, arrival) order: r3 arrived later but has the higher priority
    assert list(sim.scheduler.waiting) == [r3, r0]
    sim.run()
    # later r1 and r2 (both priority 0) outgrow the cache: the newer, r2, is preempted; it goes back
    # ahead of r0 (priority 1), which waits until the priority-0 sequences are done
    assert admission_order(sim) == ["r0", "r1", "r2", "r3", "r2", "r0"]
    assert r1.num_preemptions == r3.num_preemptions == 0 and r0.num_preemptions == r2.num_preemptions == 1


def test_kv_shortage_under_fcfs_preempts_the_newest_and_requeues_it_first() -> None:
    sim = shortage("fcfs")
    r0, r1, r2, r3 = sim.seqs
    out = sim.outputs[2]
    assert out.preempted == [r2] and out.seqs == [r0, r1], "the newest is preempted; priorities are ignored"
    assert list(sim.scheduler.waiting) == [r2, r3], "the preempted sequence goes to the front"
    sim.run()
    assert r0.num_preemptions == 0, "the oldest runs through, whatever its priority"


def test_equal_priorities_preempt_the_newest() -> None:
    # test_preemption_recomputes_and_everyone_finishes under priority, all at priority 5: the same victim
    w = Workload(
        block_size=2,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        extra_blocks=2,
        requests=[Request(0, [0, 1, 2, 0], 12, priority=5), Request(0, [2, 2, 1, 0, 1], 11, priority=5)],
        policy="priority",
    )
    sim = Simulation(w)
    sim.run()
    assert sim.seqs[0].num_preemptions == 0 and sim.seqs[1].num_preemptions > 0
    # with the newer one more urgent, the older one is the victim
    w.requests[1].priority = 4
    sim = Simulation(w)
    sim.run()
    assert sim.seqs[0].num_preemptions > 0 and sim.seqs[1].num_preemptions == 0


def test_priority_queue_order_and_removal() -> None:
    q = PriorityQueue()
    params = SamplingParams(max_tokens=1)
    seqs = [Sequence(i, f"r{i}", 0, [0], params, 1, float(a), priority=p) for i, (p, a) in enumerate(
        [(1, 0), (0, 3), (0, 1), (-1, 5), (0, 1)]
    )]  # fmt: skip
    for seq in seqs:
        q.add(seq)
    assert [s.seq_id for s in q] == [3, 2, 4, 1, 0], "(priority, arrival), then insertion"
    assert q[0] is seqs[3] and len(q) == 5
    del q[0]
    q.remove(seqs[4])
    q.prepend(seqs[4])  # a preempted sequence: back into the order, not to the front
    assert [s.seq_id for s in q] == [2, 4, 1, 0]
    with pytest.raises(ValueError):
        q.remove(seqs[3])
    with pytest.raises(ValueError, match="Unknown scheduling policy"):
        Scheduler(BlockManager(4, 4), 8, 2, 16, policy="lifo")
