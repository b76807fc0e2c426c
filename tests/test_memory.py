"""Activation memory as a measured figure (runtime/held.py) against the planner's prediction
(the simulator's peak micro-batches in flight x the profiled bytes one micro-batch holds), with
and without recomputation; and the planner's prices of the chunked methods (interleaved, zb-v)
against the simulator on hand-made profiles."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeoptim import Pipeline, get_method
from pipeoptim.throughput import predict
from pipeoptim.throughput import candidate_problem
from pipeoptim.profile import LayerProfile, ModelProfile, profile_model
from pipeoptim.runtime.held import HeldActivations
from pipeoptim.schedules import Costs, build_schedule, simulate

WIDTH, ROWS = 16, 2  # a micro-batch of 2 rows of 16 float32: 128 bytes per activation
PER_TENSOR = WIDTH * ROWS * 4


def model(blocks: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(blocks)],
                         nn.Linear(WIDTH, 3))


def data(count: int = 3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS * 4, WIDTH, generator=g), torch.randint(0, 3, (ROWS * 4,), generator=g))
            for _ in range(count)]


def measured(method: str, recompute: bool = False, partition=(2, 3), stages: int = 2):
    pipe = Pipeline(model(), method=method, loss_fn=nn.functional.cross_entropy,
                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), stages=stages, partition=list(partition),
                    micro_batches=4, recompute=recompute)
    return pipe.fit(data()).metrics["activations"]


def simulated_in_flight(method: str, stages: int = 2):
    return simulate(get_method(method).build_schedule(stages, 4, 3)).peak_activations


@pytest.fixture(scope="module")
def profile():
    return profile_model(model(), torch.randn(ROWS, WIDTH))


def test_a_micro_batch_holds_what_the_profile_says(profile):
    # stage 0 = two blocks: the input, two ReLU outputs (the second one also its output): 3 tensors
    assert profile.held_bytes(0, 2) == 3 * PER_TENSOR
    # with recomputation: its input and its output only
    assert profile.held_bytes(0, 2, recompute=True) == 2 * PER_TENSOR
    # the last stage keeps its received input with recomputation (its output is the loss)
    assert profile.held_bytes(2, 5, recompute=True) == PER_TENSOR


@pytest.mark.parametrize("method, in_flight", [("gpipe", 4), ("1f1b-flush", 2), ("zb-h1", 2)])
def test_the_measured_peak_is_the_simulated_in_flight_count_times_the_bytes_per_micro_batch(
        method, in_flight, profile):
    """2 stages, M = 4: the first stage holds M micro-batches under gpipe, N = 2 under 1F1B (zb-h1:
    until the weight half), each of them the profiled bytes exactly."""
    stages = measured(method)
    assert simulated_in_flight(method)[0] == in_flight
    assert stages[0]["peak_microbatches"] == in_flight
    assert stages[0]["microbatch_bytes"] == profile.held_bytes(0, 2)
    assert stages[0]["peak_bytes"] == in_flight * profile.held_bytes(0, 2)
    # the last stage: the simulator's count too (its bytes add what the loss saves, not profiled)
    assert stages[1]["peak_microbatches"] == simulated_in_flight(method)[1]
    assert stages[1]["microbatch_bytes"] >= profile.held_bytes(2, 5)


@pytest.mark.parametrize("method", ["gpipe", "1f1b-flush", "zb-h1"])
def test_recomputation_keeps_at_most_one_layers_share_plus_one_layer(method, profile):
    plain, light = measured(method), measured(method, recompute=True)
    for k, layers in enumerate((2, 3)):
        assert light[k]["peak_microbatches"] == plain[k]["peak_microbatches"]
        one_layer = plain[k]["peak_microbatches"] * PER_TENSOR
        assert light[k]["peak_bytes"] <= plain[k]["peak_bytes"] / layers + one_layer
    assert light[0]["peak_bytes"] == simulated_in_flight(method)[0] * profile.held_bytes(0, 2, recompute=True)
    assert light[1]["peak_bytes"] == simulated_in_flight(method)[1] * profile.held_bytes(2, 5, recompute=True)


def test_chunks_report_per_model_stage():
    """interleaved, 2 processes x 2 chunks: each of the 4 model stages measures the simulator's
    peak count of micro-batches in flight."""
    stages = measured("interleaved", partition=(1, 1, 1, 2))
    assert [s["peak_microbatches"] for s in stages] == simulated_in_flight("interleaved")


def test_held_activations_count_a_shared_storage_once_and_free_on_release():
    held = HeldActivations()
    x = torch.randn(8, 4)
    with held.forward(0, []):
        pass
    held.keep(0, [x[:2], x[:2].t(), x[2:4]])  # the same rows twice, then the next rows: 4 rows
    assert held.now == held.peak_bytes == 4 * 4 * 4
    held.release(0)
    assert held.now == 0 and held.peak_bytes == 64 and held.peak_microbatches == 1


# -- the planner's prices of the chunked methods ---------------------------------------------------

def synthetic(layers: int, forward: float = 0.001, backward: float = 0.002) -> ModelProfile:
    rows = [LayerProfile(index=i, name="L", forward=forward, backward=backward, output_bytes=100,
                         saved_bytes=100, saved_input_bytes=100, saved_output_bytes=0, parameter_bytes=1000,
                         parameters=250) for i in range(layers)]
    return ModelProfile(layers=rows, device="cpu", batch_size=4, input_bytes=100, warmup=0, repeats=1, threads=1)


def test_interleaved_is_priced_as_the_simulator_runs_it_and_matches_the_closed_form():
    """4 equal pieces (F = 1 ms, B = 2 ms) on 2 processes, M = 2: (V M + N - 1) (F + B) = 15 ms,
    bubble (N - 1) / (V M + N - 1) = 1/5; gpipe on 2 stages of 2 layers takes (M + N - 1) 2 (F + B)."""
    prof = synthetic(4)
    row = predict("interleaved", prof, [1, 1, 1, 1], microbatches=2, batches=1, batch_size=8)
    assert row["makespan_seconds"] == pytest.approx(0.015)
    assert row["bubble_fraction"] == pytest.approx(1 / 5)
    costs = Costs.uniform(4, 0.001, 0.002)
    assert row["makespan_seconds"] == pytest.approx(simulate(build_schedule("interleaved-1f1b", 2, 2), costs).makespan)
    gpipe = predict("gpipe", prof, [2, 2], microbatches=2, batches=1, batch_size=8)
    assert gpipe["makespan_seconds"] == pytest.approx(0.018)
    # memory per process: rank 0 holds pieces 0 and 2
    assert [r["rank"] for r in row["memory"]] == [0, 1, 0, 1]
    assert row["process_memory"][0] == row["memory"][0]["total"] + row["memory"][2]["total"]
    assert row["max_stage_memory"] == max(row["process_memory"])


def test_zb_v_is_priced_as_the_simulator_runs_it_with_speeds_per_process():
    prof = synthetic(4)
    row = predict("zb-v", prof, [1, 1, 1, 1], microbatches=4, batches=2, batch_size=8, speeds=[1.0, 2.0])
    # V placement: pieces 0 and 3 on process 0 (speed 1), pieces 1 and 2 on process 1 (speed 2)
    assert row["stage_forward_seconds"] == pytest.approx([0.001, 0.0005, 0.0005, 0.001])
    costs = Costs([0.001, 0.0005, 0.0005, 0.001], [0.002, 0.001, 0.001, 0.002], [0.001, 0.0005, 0.0005, 0.001])
    assert row["makespan_seconds"] == pytest.approx(simulate(build_schedule("zb-v", 2, 4, 2), costs).makespan)
    assert [r["rank"] for r in row["memory"]] == [0, 1, 1, 0]
    even = predict("zb-v", prof, [1, 1, 1, 1], microbatches=4, batches=1, batch_size=8)
    h1 = predict("zb-h1", prof, [2, 2], microbatches=4, batches=1, batch_size=8)
    assert even["bubble_fraction"] <= h1["bubble_fraction"]  # equal at N = 2, M = 4 (13 time units each)


def test_chunked_candidates_need_layers_and_a_multiple_of_the_stages():
    assert "has 3 layers" in candidate_problem("zb-v", 2, 4, 8, layers=3)
    assert candidate_problem("zb-v", 2, 3, 8, layers=4) is None
    assert "multiple of the stages" in candidate_problem("interleaved", 2, 3, 8, layers=4)
    with pytest.raises(ValueError, match="multiple of 2 pieces"):
        predict("interleaved", synthetic(3), [1, 1, 1], microbatches=2, batches=1, batch_size=8)


def test_bench_reports_the_measured_peak_against_the_prediction(tmp_path, capfd):
    """`pipeoptim bench --ablate recompute`: every pipelined run twice; per stage the measured peak
    of activations held against the prediction, equal on the first stage of the blocks model
    (1f1b-flush and gpipe at N = M = 2: 2 micro-batches in flight, each the profiled bytes)."""
    import json

    from pipeoptim.cli import main

    assert main(["bench", "--synthetic", "--batches", "2", "--warmup", "0", "--batch-size", "16",
                 "--methods", "1f1b-flush,gpipe", "--ablate", "recompute", "--no-baselines", "--repeats", "1",
                 "--json", "--out", str(tmp_path / "bench.json"), "--timeout", "60"]) == 0
    result = json.loads(capfd.readouterr().out)
    assert set(result["samples_per_second"]) == {"1f1b-flush", "1f1b-flush+recompute", "gpipe", "gpipe+recompute"}
    assert result["settings"]["ablate"] == ["recompute"]
    rows, image, width = 8, 28 * 28 * 4, 512 * 4  # micro-batch rows; bytes of one row's image, of one feature row
    for name in result["samples_per_second"]:
        first = result["detail"][name]["activations"][0]
        assert first["measured_in_flight"] == first["predicted_in_flight"] == 2
        assert first["measured_bytes"] == first["predicted_bytes"]
        # the input and 4 ReLU outputs per micro-batch; with recomputation the input and the output
        per_mb = rows * (image + width) if name.endswith("+recompute") else rows * (image + 4 * width)
        assert first["measured_bytes_per_microbatch"] == per_mb


def test_a_shape_measured_alike_twice_is_counted_without_the_hooks():
    held = HeldActivations()
    x = torch.ones(4, 4, requires_grad=True)
    calls = []

    def weights():
        calls.append(1)
        return []

    for mb in range(4):
        with held.forward(mb, weights, signature=("4x4",)):
            y = (x * 2).sin()  # sin saves its input, x * 2: 64 bytes (a scalar's product saves nothing)
        held.keep(mb, ())
    assert calls == [1, 1]  # measured twice, then taken as known
    assert held.now == held.peak_bytes == 4 * 64 and held.microbatch_bytes == 64
    for mb in range(4):
        held.release(mb)
    assert held.now == 0 and held.peak_microbatches == 4
    # a shape whose two measurements differ stays measured
    varying = HeldActivations()
    for mb, n in enumerate((4, 8, 4)):
        with varying.forward(mb, lambda: [], signature="same"):
            (torch.ones(n, requires_grad=True) * 2).sin()
        varying.keep(mb, ())
    assert varying.known_bytes("same") is None and varying.now == 16 + 32 + 16
    # no signature: measured every time
    assert HeldActivations().known_bytes(None) is None
    del y


def test_the_signature_of_a_micro_batch_is_its_shapes_or_none():
    from pipeoptim.compat import tree_flatten
    from pipeoptim.runtime.held import signature

    a, b = torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int64)
    assert signature(a, None) == signature(torch.ones(2, 3), None)  # values do not count, shapes do
    assert signature(a, None) != signature(torch.zeros(3, 3), None)
    assert signature(a, None) != signature(b, None)  # nor do dtypes
    cpu = torch.device("cpu")
    structure = tree_flatten(({"x": (a, b)}, 3))[1]  # the nesting and the dict's keys
    assert signature({"x": (a, b)}, 3) == (structure, (((2, 3), torch.float32, cpu), ((2, 3), torch.int64, cpu), 3))
    assert signature({"x": (a, b)}, 3) != signature({"y": (a, b)}, 3) != signature({"y": [a, b]}, 3)
    assert signature(object()) is None  # anything else: measured every time
