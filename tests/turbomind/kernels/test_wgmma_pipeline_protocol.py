"""The wgmma GEMM's producer/consumer protocol (`w4a16_wgmma.cu`) as a model, run under random schedules: the
producer warpgroup and the two consumer warpgroups as coroutines that block where the source waits, mbarriers with
the hardware's parity rule (try_wait.parity(p) passes once the phase of parity p is over, i.e. while the count of
completed phases has the other parity), and wgmma reads that stay in flight until a wait retires their group.

Checked for every schedule: no deadlock; the producer never writes a stage (copies or its dequantized A tile) while
a consumer's wgmma group may still read it; a consumer's wgmma reads the stage of the iteration it computes, fully
written. A stage's landing is one arrival here: the transaction bytes are the lane emulation's to check
(`wgmma_lanes`: STAGE_TX), and so are the partial slots and counters of shared tiles. The waits and arrivals use
the source's own formulas (quoted beside them), so a change there that breaks
the protocol breaks this test; `test_w4a16_wgmma` checks that the source still says them."""

from __future__ import annotations

import random
from collections.abc import Generator
from dataclasses import dataclass, field

import pytest


@dataclass
class Barrier:
    expected: int  # arrivals that complete a phase
    arrived: int = 0
    completed: int = 0  # phases completed so far

    def arrive(self) -> None:
        self.arrived += 1
        assert self.arrived <= self.expected
        if self.arrived == self.expected:
            self.arrived, self.completed = 0, self.completed + 1

    def passes(self, parity: int) -> bool:  # mbarrier.try_wait.parity
        return self.completed % 2 != parity


@dataclass
class Stage:
    iteration: int = -1  # whose data it holds
    landed: bool = False  # its copies have landed (the TMA unit's bytes on full)
    complete: bool = False  # what the consumers read is there: landed (RS), and A dequantized (SS)
    readers: set[tuple[int, int]] = field(default_factory=set)  # (consumer, iteration) of wgmma groups in flight


def producer(stages: list[Stage], full: list[Barrier], ready: list[Barrier], empty: list[Barrier], count: int,
             n_stages: int, rs: bool, in_flight: list[int]) -> Generator[object, None, None]:
    """Thread 0 issues a stage's copies (`in_flight`: stages whose bytes are still on their way, landed by `tma`);
    SS: the warpgroup then waits for iteration i's bytes, dequantizes and arrives on ready."""
    prefetch = n_stages - 1 if rs else n_stages - 2  # PREFETCH

    def issue(s: int, it: int) -> None:
        assert not stages[s].readers, f"stage {s} overwritten under wgmma reads {stages[s].readers}"
        assert s not in in_flight, f"stage {s} refilled before its copies landed"
        stages[s].iteration, stages[s].landed, stages[s].complete = it, False, False
        in_flight.append(s)

    for j in range(min(prefetch, count)):  # the prologue's copies (weights, then x after the PDL wait)
        issue(j, j)
        yield
    for i in range(count):
        j = i + prefetch
        if j < count:
            sj = j % n_stages
            if j >= n_stages:  # barrier_wait(empty + 8 * sj, ((j / STAGES) & 1) ^ 1)
                while not empty[sj].passes(((j // n_stages) & 1) ^ 1):
                    yield "blocked"
            issue(sj, j)  # barrier_expect(full + 8 * sj, STAGE_TX), copy_weights, tensor_copy
        yield
        if rs:
            continue
        s = i % n_stages
        while not full[s].passes((i // n_stages) & 1):  # barrier_wait(full + 8 * s, (i / STAGES) & 1)
            yield "blocked"
        assert stages[s].iteration == i and stages[s].landed and not stages[s].readers
        stages[s].complete = True  # dequant_stage, fence_async_proxy, producers_sync
        yield
        ready[s].arrive()  # barrier_arrive(ready + 8 * s)


def tma(stages: list[Stage], full: list[Barrier], in_flight: list[int], rs: bool, rng: random.Random
        ) -> Generator[object, None, None]:
    """The copies land in any order; a stage's last byte completes its full barrier's phase."""
    while True:
        if not in_flight:
            yield "idle"
            continue
        s = in_flight.pop(rng.randrange(len(in_flight)))
        stages[s].landed = True
        stages[s].complete = rs
        full[s].arrive()
        yield


def consumer(me: int, stages: list[Stage], full: list[Barrier], empty: list[Barrier], segments: list[int],
             n_stages: int, arrives: bool, groups: int = 1, depth: int = 1,
             release_at: int | None = None) -> Generator[object, None, None]:
    """`groups` wgmma groups an iteration: 1 (A from shared memory: one group of 4 k16 steps) or 4 (RS: a group a
    k16 step, each after this warpgroup decoded its A fragments from the stage's words), `depth` of them left in
    flight by each wait (RS_DEPTH); the previous stage goes back after the wait of step depth - 1 (`release_at`
    overrides it, to check that the model sees a release too early)."""
    release_at = depth - 1 if release_at is None else release_at
    in_flight: list[int] = []  # iterations of the wgmma groups not yet retired, oldest first

    def retire(keep: int) -> None:  # wgmma_wait<keep>
        while len(in_flight) > keep:
            it = in_flight.pop(0)
            if it not in in_flight:
                stages[it % n_stages].readers.discard((me, it))

    i = 0
    previous_released = True
    for length in segments:
        for _step in range(length):
            s = i % n_stages
            while not full[s].passes((i // n_stages) & 1):  # barrier_wait(ready + 8 * s, (i / STAGES) & 1)
                yield "blocked"
            for kk in range(groups):
                assert stages[s].iteration == i and stages[s].complete, f"consumer {me} reads stage {s} for {i} early"
                stages[s].readers.add((me, i))
                in_flight.append(i)
                yield
                retire(depth)  # wgmma_wait<RS_DEPTH> (SS: <1>): the group `depth` back is done
                if kk == release_at:  # every group of iteration i - 1 is done
                    if not previous_released and arrives:
                        empty[(i - 1) % n_stages].arrive()
                    previous_released = False
                yield
            i += 1
        retire(0)  # the segment's end: its last stage goes back before the epilogue
        if arrives:
            empty[(i - 1) % n_stages].arrive()
        previous_released = True
        yield


def run(n_stages: int, segments: list[int], seed: int, arrives: bool = True, groups: int = 1, depth: int = 1,
        release_at: int | None = None) -> None:
    """`groups` 4 is RS: consumers wait on full; SS (1) on ready, which the producer arrives on after its decode."""
    count, rs = sum(segments), groups == 4
    rng = random.Random(seed)
    stages = [Stage() for _ in range(n_stages)]
    full = [Barrier(1) for _ in range(n_stages)]
    ready = full if rs else [Barrier(1) for _ in range(n_stages)]
    empty = [Barrier(2) for _ in range(n_stages)]
    # both consumers arrive on empty (one thread of each warpgroup): the empty barriers expect 2
    in_flight: list[int] = []
    actors = [producer(stages, full, ready, empty, count, n_stages, rs, in_flight),
              consumer(0, stages, ready, empty, segments, n_stages, arrives, groups, depth, release_at),
              consumer(1, stages, ready, empty, segments, n_stages, arrives, groups, depth, release_at)]
    landing = tma(stages, full, in_flight, rs, rng)
    live = list(actors)
    stalled = 0
    while live:
        actor = rng.choice(live + [landing])
        try:
            state = next(actor)
        except StopIteration:
            live.remove(actor)
            stalled = 0
            continue
        stalled = stalled + 1 if state in ("blocked", "idle") else 0
        assert stalled < 10_000, "deadlock: every actor is waiting"
    assert not in_flight


@pytest.mark.parametrize("groups, depth", [(1, 1), (4, 1), (4, 3)], ids=["ss", "rs", "rs-d3"])
@pytest.mark.parametrize("n_stages", [3, 4, 6])
def test_random_schedules_keep_the_protocol(n_stages: int, groups: int, depth: int) -> None:
    rng = random.Random(n_stages)
    for seed in range(150):
        count = rng.randint(1, 3 * n_stages + 5)
        segments = []
        left = count
        while left:  # stream-K segments: runs of one tile's k tiles, the first and last possibly short
            segments.append(rng.randint(1, left))
            left -= segments[-1]
        run(n_stages, segments, seed, groups=groups, depth=depth)


def test_the_model_catches_a_release_before_the_deeper_groups_are_done() -> None:
    """RS with 3 groups in flight that hands the previous stage back after its first step's wait (as depth 1 does)
    releases it under the previous tile's last groups: caught."""
    with pytest.raises(AssertionError, match="overwritten under wgmma reads"):
        for seed in range(100):
            run(3, [12], seed, groups=4, depth=3, release_at=0)


def test_the_model_sees_a_deadlock() -> None:
    """Consumers that never hand a stage back stall the producer at its first refill, and it is reported."""
    with pytest.raises(AssertionError, match="deadlock"):
        run(3, [12], 0, arrives=False)


def test_the_model_catches_a_release_before_the_reads_are_over(monkeypatch) -> None:
    """A consumer that releases a stage while its wgmma may still read it (no wait before the arrive) is caught."""

    def hasty(me, stages, full, empty, segments, n_stages, arrives, groups, depth, release_at):
        i = 0
        for length in segments:
            for _ in range(length):
                s = i % n_stages
                while not full[s].passes((i // n_stages) & 1):
                    yield "blocked"
                stages[s].readers.add((me, i))  # issued, never retired before the release
                empty[s].arrive()
                i += 1
                yield

    monkeypatch.setitem(globals(), "consumer", hasty)
    with pytest.raises(AssertionError, match="overwritten under wgmma reads"):
        for seed in range(50):
            run(3, [12], seed)


def test_the_model_catches_a_wrong_parity(monkeypatch) -> None:
    """Waiting on `empty` with the parity of the phase before (no ^ 1) lets the producer refill a stage too early."""

    def eager(stages, full, ready, empty, count, n_stages, rs, in_flight):
        prefetch = n_stages - 2
        for j in range(min(prefetch, count)):
            stages[j].iteration, stages[j].landed, stages[j].complete = j, False, False
            in_flight.append(j)
            yield
        for i in range(count):
            j = i + prefetch
            if j < count:
                sj = j % n_stages
                if j >= n_stages:
                    while not empty[sj].passes((j // n_stages) & 1):
                        yield "blocked"
                assert not stages[sj].readers, f"stage {sj} overwritten under wgmma reads {stages[sj].readers}"
                stages[sj].iteration, stages[sj].landed, stages[sj].complete = j, False, False
                in_flight.append(sj)
            yield
            s = i % n_stages
            while not full[s].passes((i // n_stages) & 1):
                yield "blocked"
            stages[s].complete = True
            yield
            ready[s].arrive()

    monkeypatch.setitem(globals(), "producer", eager)
    with pytest.raises(AssertionError):
        for seed in range(50):
            run(3, [5, 7], seed)
