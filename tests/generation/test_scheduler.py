"""The engine's batching policy alone (`generation/scheduler.py`): no model, no torch, no threads.

Sequences here carry only what the scheduler reads: a prompt, an arrival id, what is cached and
the tokens generated so far; `run_step` plays the engine's part (one token per sampled row)."""

import subprocess
import sys

import pytest

from shardwise.generation.scheduler import DecodeBatch, PrefillRow, Scheduler, power_of_two_at_least
from shardwise.generation.sequence import Sequence


def sequence(prompt_len: int, id: int) -> Sequence:
    return Sequence(list(range(1, prompt_len + 1)), params=None, on_output=None, generator=None, stream=None,
                    stop_ids=frozenset(), id=id)


def submitted(scheduler: Scheduler, *prompt_lens: int) -> list[Sequence]:
    seqs = [sequence(n, id) for id, n in enumerate(prompt_lens)]
    for seq in seqs:
        scheduler.add(seq)
    return seqs


def run_step(scheduler: Scheduler) -> tuple[list[PrefillRow], DecodeBatch | None]:
    """One engine step without a model: every sampled row gets token 7."""
    scheduler.take_cancelled()
    scheduler.admit()
    prefill = scheduler.prefill_batch()
    for row in scheduler.prefilled(prefill):
        prefill[row].seq.output_ids.append(7)
    decode = scheduler.decode_batch()
    if decode:
        scheduler.decoded(decode)
        for seq in decode.seqs:
            seq.output_ids.append(7)
    return prefill, decode


def test_admission_is_first_come_into_the_lowest_free_slot_and_nothing_is_preempted():
    scheduler = Scheduler(3, prefill_chunk=256)
    seqs = submitted(scheduler, 4, 4, 4, 4, 4)
    assert scheduler.admit() == seqs[:3]
    assert [seq.slot for seq in seqs] == [0, 1, 2, None, None]
    assert scheduler.num_running() == 3 and scheduler.num_waiting() == 2
    late = sequence(1, id=9)
    scheduler.add(late)  # a full engine: the newcomer waits, the running keep their slots
    assert scheduler.admit() == [] and [seq.slot for seq in seqs[:3]] == [0, 1, 2]
    assert list(scheduler.waiting) == [seqs[3], seqs[4], late]


def test_an_ended_sequence_frees_its_slot_for_the_next_in_line():
    scheduler = Scheduler(3, prefill_chunk=256)
    seqs = submitted(scheduler, 2, 2, 2, 2, 2)
    scheduler.admit()
    scheduler.free(seqs[2])
    scheduler.free(seqs[0])
    assert seqs[0].slot is None and scheduler.slots == [None, seqs[1], None]
    assert scheduler.admit() == [seqs[3], seqs[4]]
    assert (seqs[3].slot, seqs[4].slot) == (0, 2)  # lowest free slot first, in arrival order
    scheduler.free(seqs[0])  # freeing a sequence that holds no slot changes nothing
    assert scheduler.slots == [seqs[3], seqs[1], seqs[4]]


def test_prefill_takes_prompt_tokens_in_arrival_order_within_the_chunk():
    scheduler = Scheduler(4, prefill_chunk=8)
    last, first, second = sequence(10, id=3), sequence(3, id=1), sequence(20, id=2)
    for seq in (last, first, second):  # slots 0, 1, 2: slot order is not arrival order
        scheduler.add(seq)
    scheduler.admit()
    batch = scheduler.prefill_batch()
    assert batch == [(first, 3), (second, 5)]
    assert scheduler.prefilled(batch) == [0]  # first's prompt is whole: it samples
    assert (first.num_cached, second.num_cached, last.num_cached) == (3, 5, 0)
    assert scheduler.prefill_batch() == [(second, 8)]


def test_an_encoder_takes_whole_prompts_while_the_budget_lasts_at_least_one():
    scheduler = Scheduler(4, prefill_chunk=8, whole_prompts=True)
    seqs = submitted(scheduler, 5, 6, 2)
    scheduler.admit()
    assert scheduler.prefill_batch() == [(seqs[0], 5)]  # 6 more would pass the budget of 8
    scheduler = Scheduler(4, prefill_chunk=8, whole_prompts=True)
    long, _ = submitted(scheduler, 12, 1)
    scheduler.admit()
    assert scheduler.prefill_batch() == [(long, 12)]
    scheduler.started([long])
    assert (long.position_offset, long.num_cached, long.prefilling) == (12, 13, False)


def test_a_long_prompt_is_prefilled_in_chunks_while_the_running_sequence_decodes_every_step():
    scheduler = Scheduler(2, prefill_chunk=8)
    running, = submitted(scheduler, 3)
    run_step(scheduler)
    assert running.output_ids == [7, 7]  # prefilled, sampled, and decoded in the same step
    long = sequence(20, id=1)
    scheduler.add(long)
    chunks = []
    for step in range(3):
        prefill, decode = run_step(scheduler)
        chunks.append([(row.seq.id, row.num_tokens) for row in prefill])
        assert running in decode.seqs and len(running.output_ids) == 3 + step
    assert chunks == [[(1, 8)], [(1, 8)], [(1, 4)]]
    assert long.num_cached == 21 and long.output_ids == [7, 7]  # its prompt, then its first token fed back
    assert running.num_cached == 3 + 4


def test_decode_rows_are_the_slots_up_to_a_power_of_two_at_most_the_slots():
    scheduler = Scheduler(6, prefill_chunk=256)
    seqs = submitted(scheduler, 2, 2, 2, 2, 2)
    scheduler.admit()
    assert scheduler.decode_batch() is None  # nothing cached, nothing to feed
    seqs[3].num_cached = 2
    assert scheduler.decode_batch() is None  # a whole prompt without its first token: nothing to feed yet
    for seq in (seqs[0], seqs[2]):
        seq.num_cached, seq.output_ids = 2, [5]
    batch = scheduler.decode_batch()
    assert batch.seqs == [seqs[0], seqs[2]] and batch.num_rows == 4
    seqs[4].num_cached, seqs[4].output_ids = 2, [5]
    assert scheduler.decode_batch().num_rows == 6  # 8 rows would pass the 6 slots
    seqs[1].num_cached = 1  # still prefilling: never decoded, even with an output
    seqs[1].output_ids = [5]
    assert seqs[1] not in scheduler.decode_batch().seqs
    assert [power_of_two_at_least(n) for n in (0, 1, 2, 3, 5, 16, 17)] == [1, 1, 2, 4, 8, 16, 32]


def test_cancelled_sequences_leave_the_line_and_are_handed_back_once():
    scheduler = Scheduler(1, prefill_chunk=256)
    running, waiting, other = submitted(scheduler, 2, 2, 2)
    scheduler.admit()
    scheduler.cancel(waiting)
    scheduler.cancel(running)
    assert scheduler.take_cancelled() == {waiting, running}
    assert list(scheduler.waiting) == [other] and running.slot == 0  # the engine ends it, then frees
    assert scheduler.take_cancelled() == set()
    scheduler.free(running)
    assert scheduler.admit() == [other]
    assert scheduler.take_waiting() == [] and scheduler.has_work()


def test_work_is_left_while_anything_waits_runs_or_is_cancelled():
    scheduler = Scheduler(1, prefill_chunk=256)
    assert not scheduler.has_work()
    seq, = submitted(scheduler, 2)
    assert scheduler.has_work()
    assert scheduler.take_waiting() == [seq] and not scheduler.has_work()
    scheduler.cancel(seq)  # a cancellation alone is work: the engine must still end the sequence
    assert scheduler.has_work()
    scheduler.take_cancelled()
    scheduler.add(seq)
    scheduler.admit()
    assert scheduler.has_work() and scheduler.running() == [seq]


def test_a_prefill_chunk_below_one_is_refused():
    with pytest.raises(ValueError, match="prefill_chunk = 0 is invalid: prefill at least 1 token per step"):
        Scheduler(2, prefill_chunk=0)


def test_the_scheduler_imports_no_torch():
    code = "import sys; sys.modules['torch'] = None; import shardwise.generation.scheduler"
    subprocess.run([sys.executable, "-c", code], check=True)
