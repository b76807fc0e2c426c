"""The planner's prediction of the mirrored methods (bidirectional, bitpipe): a split into their
pieces, whose stages are those pieces twice; the simulator's makespan and bubble of their
schedules, each process's memory with both replicas of its pieces, and the replicas' gradient
sum at the bandwidth added to every mini-batch."""
from __future__ import annotations

import pytest

from pipeoptim.methods import get_method
from pipeoptim.throughput import candidate_problem, predict, replica_sum_seconds, stage_placement
from pipeoptim.schedules import Costs, simulate
from test_planner import synthetic


def uniform(layers: int):
    # every layer: F = 1 ms, B = 2 ms, 1000 parameter bytes, 10 saved activation bytes per micro-batch
    return synthetic([0.001] * layers, [0.002] * layers, saved=[10] * layers)


@pytest.mark.parametrize("method,ranks", [("bidirectional", 2), ("bidirectional", 4), ("bitpipe", 2),
                                          ("bitpipe", 4)])
def test_the_makespan_and_bubble_are_the_simulators_on_the_pieces_costs(method, ranks):
    meth = get_method(method)
    pieces = ranks * meth.pieces_per_rank(meth.chunks)
    prof = uniform(pieces)
    row = predict(method, prof, [1] * pieces, microbatches=4, batches=3, batch_size=8)
    schedule = meth.build_schedule(ranks, 4, 3)
    assert schedule.num_stages == 2 * pieces
    sim = simulate(schedule, Costs.uniform(2 * pieces, 0.001, 0.002))
    assert row["makespan_seconds"] == pytest.approx(sim.makespan)
    assert row["bubble_fraction"] == pytest.approx(sim.bubble_fraction)
    assert row["replica_sum_seconds"] == [0.0] * ranks  # no bandwidth given: not priced
    # each process holds 2 pieces' stages per direction (bitpipe) or 1 (bidirectional), each with
    # its weights, gradient and optimizer state: twice a one-pipeline split's per process
    per_process = [sum(r["weights"] for r in row["memory"] if r["rank"] == k) for k in range(ranks)]
    assert per_process == [2 * meth.pieces_per_rank(meth.chunks) * 1000] * ranks
    assert [r["rank"] for r in row["memory"]] == meth.stage_ranks(ranks, meth.chunks)


def test_bitpipe_beats_bidirectional_and_interleaved_in_the_simulator():
    """At N = 4, M = 8 on one model of 8 equal layers: bitpipe's two Vs (8 pieces) leave less
    bubble than interleaved 1F1B with 2 chunks (8 pieces) and than Chimera's two straight
    pipelines (4 pieces), more than zb-v's split backward: makespans 26.5, 28.5, 29 and 25.5
    units (a unit: the forward of 2 layers, the backward 2 units) for 24 busy per rank."""
    prof = uniform(8)
    split = {"bitpipe": [1] * 8, "interleaved": [1] * 8, "zb-v": [1] * 8, "bidirectional": [2] * 4}
    rows = {m: predict(m, prof, sizes, microbatches=8, batches=1, batch_size=8) for m, sizes in split.items()}
    bubble = {m: row["bubble_fraction"] for m, row in rows.items()}
    assert bubble == pytest.approx({"bitpipe": 1 - 24 / 26.5, "interleaved": 1 - 24 / 28.5, "zb-v": 1 - 24 / 25.5,
                                    "bidirectional": 1 - 24 / 29})
    assert rows["bitpipe"]["makespan_seconds"] == pytest.approx(26.5 * 0.002)  # a unit: 2 layers
    # at M = 4 (12 busy units per rank): 14.3 %, 27.3 %, 11.1 % and 25.0 % (README, "Speed, measured")
    four = {m: predict(m, prof, sizes, microbatches=4, batches=1, batch_size=8)["bubble_fraction"]
            for m, sizes in split.items()}
    assert four == pytest.approx({"bitpipe": 1 - 12 / 14, "interleaved": 1 - 12 / 16.5, "zb-v": 1 - 12 / 13.5,
                                  "bidirectional": 1 - 12 / 16})


def test_the_replica_sum_is_priced_at_the_bandwidth_and_added_to_every_mini_batch():
    prof = uniform(4)
    plain = predict("bitpipe", prof, [1] * 4, microbatches=2, batches=5, batch_size=8)
    priced = predict("bitpipe", prof, [1] * 4, microbatches=2, batches=5, batch_size=8, bandwidth=1e6)
    # on 2 ranks each process holds all 4 pieces, each of whose other replica is on the other rank:
    # 4 x 1000 bytes at 1e6 bytes/s per update
    assert replica_sum_seconds(prof, "bitpipe", [1] * 4, 1e6) == pytest.approx([0.004, 0.004])
    assert priced["replica_sum_seconds"] == pytest.approx([0.004, 0.004])
    # the activations at 1e6 bytes/s cost 1e-4 s per message; the sum adds 5 x 4 ms
    assert priced["makespan_seconds"] - 0.02 > plain["makespan_seconds"]
    # the middle rank of an odd N holds both replicas of its piece: nothing to send; ranks 0 and 2
    # hold one replica of pieces 0 and 2 each
    assert stage_placement("bidirectional", [1, 1, 1]) == [0, 1, 2, 2, 1, 0]
    assert replica_sum_seconds(uniform(3), "bidirectional", [1, 1, 1], 1e6) == pytest.approx([0.002, 0.0, 0.002])


def test_the_planner_offers_them_where_they_can_run():
    assert candidate_problem("bidirectional", 4, 4, 64) is None
    assert candidate_problem("bitpipe", 4, 4, 64, layers=8) is None
    assert "even number of micro-batches" in candidate_problem("bitpipe", 4, 3, 64)
    assert "4 x 2 pieces but it has 6 layers" in candidate_problem("bitpipe", 4, 4, 64, layers=6)
    with pytest.raises(ValueError, match="bitpipe holds 2 model pieces per process"):
        predict("bitpipe", uniform(3), [1] * 3, microbatches=2, batches=1, batch_size=8)
