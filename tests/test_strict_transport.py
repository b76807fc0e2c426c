"""Issue 62: the strict transport (runtime/strict.py), NCCL's rules on gloo for the tests. One
spawn of 2 processes (gloo, a file store) goes through what gloo allows and NCCL does not, and
what both allow, each on a group of its own:

* plain gloo: each rank sends to the other, then receives (on one group): gloo matches each
  receive with the peer's send, so the exchange passes;
* strict, the same exchange: each receive waits behind its own unmatched send, as on the one
  stream of NCCL's communicator for the pair, where it hangs: it fails;
* strict, rank 0 sending first and rank 1 receiving first: passes, the values arrive;
* strict, a complex64 tensor: refused at once, naming the dtype;
* strict, a pair's first operation while the peer issues none for longer than the timeout:
  refused, as NCCL's communicator creation would block;
* two groups' asynchronous all-reduces issued in opposite orders on the two ranks: gloo passes,
  strict refuses (NCCL queues a GPU's collectives in issue order: both would wait forever); in
  one order both pass; a complex64 all-reduce is refused."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from test_distributed import spawn

TIMEOUT = 2.0


def _outcome(fn) -> str:
    try:
        fn()
        return "passed"
    except Exception as error:  # noqa: BLE001 (the test reads what was raised)
        return f"{type(error).__name__}: {error}"


def _worker(rank: int, world: int, init: str, out: str) -> None:
    import datetime

    from pipeoptim.runtime import strict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    peer = 1 - rank
    said = {}

    def exchange(group, send_first: bool):
        mine, theirs = torch.full((3,), float(rank)), torch.empty(3)
        if send_first:
            sent = dist.isend(mine, dst=peer, group=group)
            dist.irecv(theirs, src=peer, group=group).wait()
            sent.wait()
        else:
            got = dist.irecv(theirs, src=peer, group=group)
            got.wait()
            dist.isend(mine, dst=peer, group=group).wait()
        assert theirs.tolist() == [float(peer)] * 3

    said["gloo, both send first"] = _outcome(lambda: exchange(dist.new_group([0, 1]), send_first=True))
    one, two = dist.new_group([0, 1]), dist.new_group([0, 1])
    pair = [torch.ones(2), torch.ones(2)]
    works = [dist.all_reduce(t, group=g, async_op=True) for g, t in ([(one, pair[0]), (two, pair[1])] if rank == 0
                                                                   else [(two, pair[1]), (one, pair[0])])]
    said["gloo, collectives in two orders"] = _outcome(lambda: [w.wait() for w in works])
    strict.install(timeout=TIMEOUT)
    try:
        said["strict, both send first"] = _outcome(lambda: exchange(dist.new_group([0, 1]), send_first=True))
        said["strict, one sends first"] = _outcome(lambda: exchange(dist.new_group([0, 1]), send_first=rank == 0))
        odd = dist.new_group([0, 1])
        said["strict, complex64"] = _outcome(
            lambda: dist.isend(torch.zeros(2, dtype=torch.complex64), dst=peer, group=odd).wait())
        first, second = dist.new_group([0, 1]), dist.new_group([0, 1])

        def two_collectives(same_order: bool):
            a, b = torch.ones(2), torch.ones(2)
            order = [(first, a), (second, b)] if same_order or rank == 0 else [(second, b), (first, a)]
            works = [dist.all_reduce(t, group=g, async_op=True) for g, t in order]
            for work in works:
                work.wait()
            assert a.tolist() == b.tolist() == [2.0, 2.0]
        said["strict, collectives in one order"] = _outcome(lambda: two_collectives(True))
        said["strict, collectives in two orders"] = _outcome(lambda: two_collectives(False))
        said["strict, complex64 all_reduce"] = _outcome(
            lambda: dist.all_reduce(torch.zeros(2, dtype=torch.complex64), group=first))
        alone = dist.new_group([0, 1])
        if rank == 0:
            said["strict, first operation alone"] = _outcome(lambda: dist.isend(torch.ones(1), dst=peer, group=alone))
        else:
            time.sleep(TIMEOUT + 1.5)  # the peer's first operation waits longer than the timeout for this one
        dist.barrier()
    finally:
        strict.uninstall()
    Path(out, f"rank{rank}.json").write_text(json.dumps(said))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_the_strict_transport_fails_where_nccl_would_hang_and_passes_where_it_would_not(tmp_path):
    spawn(_worker, 2, tmp_path, deadline=90.0)
    said = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, mine in enumerate(said):
        assert mine["gloo, both send first"] == "passed"
        assert mine["strict, both send first"] == (
            f"StrictTransportError: receive 0 on rank {rank} from rank {1 - rank} on group 0: it or its match never "
            f"started within {TIMEOUT:g} s: under NCCL this would hang")
        assert mine["strict, one sends first"] == "passed"
        assert mine["strict, complex64"].startswith(
            f"StrictTransportError: a send from rank {rank} to rank {1 - rank} of a torch.complex64 tensor on group 2")
        # two groups' collectives: gloo runs each group apart; NCCL queues them in issue order
        assert mine["gloo, collectives in two orders"] == "passed"
        assert mine["strict, collectives in one order"] == "passed"
        groups = (3, 4) if rank == 0 else (4, 3)
        assert mine["strict, collectives in two orders"] == (
            f"StrictTransportError: all_reduce on rank {rank}: ranks {rank} and {1 - rank} issue their collectives in "
            f"another order (here on group {groups[0]}, there on group {groups[1]} at the same count): NCCL queues "
            f"them in that order on each GPU and both would wait forever; issue them in one order")
        assert mine["strict, complex64 all_reduce"].startswith(
            f"StrictTransportError: all_reduce on rank {rank} of a torch.complex64 tensor on group 3: NCCL has no "
            f"such type")
    assert said[0]["strict, first operation alone"].startswith(
        "StrictTransportError: the first operation between ranks 0 and 1 on group 5 waits for both ends (rank 1 "
        "issued none)")


def _tied_worker(rank: int, world: int, init: str, out: str, warm: bool) -> None:
    """pipeoptim on a tied GPT cut in two, under the strict transport; ``warm``: with the tie's
    pair groups warmed when made (runtime/transport.warm_pair, as tied imports it), else as before the fix."""
    import os

    import pipeoptim
    from pipeoptim.runtime import strict, tied
    from pipeoptim.runtime.control import init_process_group
    from traced_models import TinyGPT, lm_batches, lm_loss

    init_process_group(init_method=init, rank=rank, world_size=world, timeout=60)
    strict.install(timeout=TIMEOUT + 2)
    if not warm:
        tied.warm_pair = lambda *args, **kwargs: None
    torch.manual_seed(0)
    try:
        with pipeoptim.Pipeline(TinyGPT(), method="pipeoptim", stages=2, loss_fn=lm_loss, timeout=60,
                                optimizer=lambda params: torch.optim.SGD(params, lr=0.1)) as pipe:
            said = [round(float(loss), 5) for loss in pipe.fit(lm_batches()).losses]
    except Exception as error:  # noqa: BLE001 (the test reads what was raised)
        said = f"{type(error).__name__}: {error}"
    Path(out, f"tied{rank}.json").write_text(json.dumps(said))
    os._exit(0)  # (a hung exchange's group cannot be torn down cleanly)


@pytest.mark.timeout(120)
def test_the_strict_transport_shows_the_tie_hang_that_the_warm_up_removes(tmp_path):
    """Issue 62's first finding, failing before its fix: the asynchronous methods' per-tie pair
    groups, first used inside the owner's forward while the holder waits for that forward's
    activation, hang under NCCL; the strict transport shows it (a rank fails within its timeout),
    and passes once each group is warmed when made, to the losses of a run without the strict rules
    (the one-process run: tests/test_tied_async.py)."""
    import pipeoptim
    from traced_models import TinyGPT, lm_batches, lm_loss

    torch.manual_seed(0)
    with pipeoptim.Pipeline(TinyGPT(), method="pipeoptim", stages=2, loss_fn=lm_loss,
                            optimizer=lambda params: torch.optim.SGD(params, lr=0.1)) as pipe:
        alone = [round(float(loss), 5) for loss in pipe.fit(lm_batches()).losses]
    for warm in (True, False):
        folder = tmp_path / str(warm)
        folder.mkdir()
        spawn(_tied_worker, 2, folder, warm, deadline=60.0)
        said = [json.loads((folder / f"tied{r}.json").read_text()) for r in range(2)]
        if warm:
            assert said == [alone, alone]
        else:
            assert any(isinstance(s, str) and "StrictTransportError" in s and "under NCCL this would hang" in s
                       for s in said), said
