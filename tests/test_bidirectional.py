"""bidirectional (Chimera's shape) and bitpipe (BitPipe's two V-shaped pipelines) on the local
runtime: two pipelines of the same pieces in opposite directions, half of each mini-batch's
micro-batches through each, the two replicas of every piece summing their gradients before each
update. Its losses and weights equal
sequential training's; the replicas are equal after every update; a resume mid-epoch equals the
uninterrupted run; under torchrun (tests/test_torchrun.py) it equals one process, with data
parallel replicas on top it is refused, saying what to do."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeoptim
from conftest import Crash, crash_at
from pipeoptim.methods import get_method
from pipeoptim.schedules import build_schedule

LOSS = nn.functional.cross_entropy


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 10), nn.Tanh()]
    for _ in range(7):  # 9 layers with weights: bitpipe on 4 ranks cuts 8 pieces
        layers += [nn.Linear(10, 10), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(10, 3)).double()


def data(n: int = 6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))
            for _ in range(n)]


ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731


def replicas_equal(pipe: pipeoptim.Pipeline) -> bool:
    half = len(pipe.stages) // 2
    return all(torch.equal(p, q) for j in range(half)
               for p, q in zip(pipe.stages[j].parameters(), pipe.stages[half + j].parameters()))


@pytest.mark.parametrize("method,stages", [("bidirectional", 2), ("bidirectional", 4), ("bitpipe", 2),
                                           ("bitpipe", 4)])
def test_it_equals_sequential_and_keeps_its_replicas_equal(method, stages):
    micro = 4
    reference = pipeoptim.train(model(), data(), method="sequential", optimizer=ADAMW, loss_fn=LOSS,
                                micro_batches=micro, epochs=2)
    pipe = pipeoptim.Pipeline(model(), method=method, stages=stages, micro_batches=micro,
                              optimizer=ADAMW, loss_fn=LOSS)
    equal_after = []
    result = pipe.fit(data(), epochs=2, on_batch=lambda i, loss: equal_after.append(replicas_equal(pipe)))
    pieces = stages * (2 if method == "bitpipe" else 1)
    assert len(pipe.stages) == 2 * pieces and [s.is_last for s in pipe.stages].count(True) == 2
    assert result.losses == pytest.approx(reference.losses, rel=1e-12)
    for got, want in zip(result.model.parameters(), reference.model.parameters()):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)
    assert replicas_equal(pipe) and all(equal_after)
    # each replica saw half of every mini-batch: the down pipeline micro-batches 0, 1 of 4
    forwards = {s.index: {e.microbatch % micro for e in s.record.trace if e.kind == "F"} for s in pipe.stages}
    assert forwards[0] == {0, 1} and forwards[pieces] == {2, 3}
    # and evaluation runs the model once, through the first pipeline
    metric = lambda out, y: (out.argmax(-1) == y).double().mean()  # noqa: E731
    assert pipe.evaluate(data(2), metric) == pytest.approx(pipeoptim.Pipeline(
        reference.model, method="sequential", optimizer=ADAMW, loss_fn=LOSS).evaluate(data(2), metric))


def test_the_updates_of_a_replica_pair_meet_in_the_same_order_on_every_rank():
    """Each rank runs its two updates in the order of their pieces, so that the two replicas of
    a piece, on ranks j and N-1-j, reach their update at the same point of their orders (what an
    exchange of their gradients between processes needs)."""
    for name, held in (("bidirectional", 2), ("bitpipe", 4)):
        for n in (2, 3, 4, 5):
            schedule = build_schedule(name, n, n + n % 2, 2)
            half = schedule.num_stages // 2
            for rank, order in enumerate(schedule.orders):
                for t in range(2):
                    pieces = [a.stage % half for a in order if a.kind.value == "U" and a.index == t]
                    assert len(pieces) == held and pieces == sorted(pieces)
                    # and the rank holding the other replicas holds the same pieces
                    partner = [a.stage % half for a in schedule.orders[n - 1 - rank]
                               if a.kind.value == "U" and a.index == t]
                    assert partner == pieces


def test_each_mini_batch_repeats_the_first_ones_order_shifted():
    """Every mini-batch is flushed and priced alike, so its order is mini-batch 0's with the
    micro-batches and the update shifted (the list scheduling runs once, not once per mini-batch:
    a schedule of 100 mini-batches costs what one does)."""
    from pipeoptim.schedules.actions import Kind

    for name in ("bidirectional", "bitpipe"):
        for n, m in ((2, 4), (3, 6), (4, 2)):
            one, three = build_schedule(name, n, m, 1), build_schedule(name, n, m, 3)
            for rank in range(n):
                assert three.orders[rank] == [
                    a._replace(index=t if a.kind is Kind.U else a.index + t * m)
                    for t in range(3) for a in one.orders[rank]]


def test_bitpipe_places_two_vs_whose_turns_are_hand_offs_in_memory():
    """The down V goes 0 .. N-1 .. 0, the up V N-1 .. 0 .. N-1; each turn is two stages of one
    rank, and a lowered schedule sends nothing across it (nor between the two pipelines)."""
    from pipeoptim.schedules.lower import lower

    assert get_method("bitpipe").stage_ranks(3, 4) == [0, 1, 2, 2, 1, 0, 2, 1, 0, 0, 1, 2]
    schedule = build_schedule("bitpipe", 3, 4, 1)
    assert schedule.pipelines == [list(range(6)), list(range(6, 12))]
    sends = {(a.stage, a.kind.value) for order in lower(schedule).orders for a in order if a.kind.is_comm}
    # forwards cross the 4 boundaries of each V between two ranks; the turns 2 -> 3 and 8 -> 9 stay
    assert {s for s, kind in sends if kind == "SEND_F"} == {0, 1, 3, 4, 6, 7, 9, 10}


@pytest.mark.parametrize("method", ["bidirectional", "bitpipe"])
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, method):
    def run(folder, **kwargs):
        return pipeoptim.train(model(), data(), method=method, stages=3, micro_batches=4,
                               optimizer=ADAMW, loss_fn=LOSS, epochs=2, checkpoint_dir=folder,
                               checkpoint_every=2, **kwargs)

    expected = run(tmp_path / "full").losses

    with pytest.raises(Crash):
        run(tmp_path / "cut", on_batch=crash_at(7))
    assert run(tmp_path / "cut", resume=True).losses == expected


def test_its_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="even number of micro-batches"):
        pipeoptim.Pipeline(model(), method="bidirectional", stages=2, micro_batches=3, optimizer=ADAMW,
                           loss_fn=LOSS).fit(data(1))
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        pipeoptim.Pipeline(model(), method="bidirectional", stages=2, chunks=3, optimizer=ADAMW, loss_fn=LOSS)
    with pytest.raises(ValueError, match="clip_scope='global' over bidirectional's two replicas"):
        pipeoptim.Pipeline(model(), method="bidirectional", stages=2, optimizer=ADAMW, loss_fn=LOSS,
                           clip_grad_norm=1.0, clip_scope="global")
    with pytest.raises(ValueError, match="bitpipe places exactly 4 chunks per stage"):
        pipeoptim.Pipeline(model(), method="bitpipe", stages=2, chunks=2, optimizer=ADAMW, loss_fn=LOSS)
    assert get_method("bidirectional").stage_ranks(3, 2) == [0, 1, 2, 2, 1, 0]


def test_with_data_parallel_replicas_it_is_refused_saying_what_to_do(torchrun_2):
    """Under torchrun it runs one pipeline (tests/test_torchrun.py: equal to one process on 2
    and 4 processes); replicas of that pipeline on top of its own two are refused, on every rank
    (tests/torchrun_refusals.py's "bidirectional", in tests/conftest.py's 2-process job)."""
    refused = [r["refused"] for r in torchrun_2.rows("refusals") if r["case"] == "bidirectional"]
    assert len(refused) == 2
    for line in refused:
        assert "bidirectional already holds two replicas of each piece" in line
        assert "run one pipeline (WORLD_SIZE = stages)" in line
