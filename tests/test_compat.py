"""Each private API of torch that pipeoptim relies on (all of them behind src/pipeoptim/compat.py)
still exists in the installed torch and behaves as relied on. A failure here means a torch release
moved or changed one: the message names the entry of compat.py to update (its docstring says the
fallback and the public alternative)."""
from __future__ import annotations

import copy
import math
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipeoptim import compat

SRC = Path(__file__).resolve().parents[1] / "src" / "pipeoptim"


def moved(what: str, entry: str) -> str:
    return (f"torch {torch.__version__}: {what}. Update pipeoptim/compat.py's {entry} "
            f"(its docstring names the fallback and the public alternative)")


def test_the_storage_use_count_exists_and_counts_a_second_reference():
    assert compat.HAS_STORAGE_USE_COUNT, moved("torch._C._storage_Use_Count is gone", "storage_use_count")
    tensor = torch.zeros(8)
    storage = tensor.untyped_storage()
    alone = compat.storage_use_count(storage)
    view = tensor[2:]
    assert compat.storage_use_count(storage) == alone + 1, \
        moved("a view no longer raises the storage's use count", "storage_use_count")
    del view
    assert compat.storage_use_count(storage) == alone, \
        moved("a dropped view no longer lowers the storage's use count", "storage_use_count")


def test_swapping_two_storages_swaps_their_data_under_every_alias():
    assert compat.CAN_SWAP_STORAGE, moved("UntypedStorage._swap_data_ptr_ is gone", "swap_storage_memory")
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0, 6.0])
    alias = a.view(3, 1)
    compat.swap_storage_memory(a.untyped_storage(), b.untyped_storage())
    assert a.tolist() == [4.0, 5.0, 6.0] and b.tolist() == [1.0, 2.0, 3.0], \
        moved("_swap_data_ptr_ no longer swaps the storages' data", "swap_storage_memory")
    assert alias.flatten().tolist() == [4.0, 5.0, 6.0], \
        moved("an alias no longer sees the swapped data", "swap_storage_memory")
    compat.swap_storage_memory(a.untyped_storage(), b.untyped_storage())
    assert a.tolist() == [1.0, 2.0, 3.0] and b.tolist() == [4.0, 5.0, 6.0]


def test_the_foreach_norm_schema_says_it_takes_a_dtype():
    try:
        schema = str(torch.ops.aten._foreach_norm.Scalar._schema)
    except (AttributeError, RuntimeError) as error:
        pytest.fail(moved(f"the schema of aten::_foreach_norm.Scalar cannot be read ({error})",
                          "FOREACH_NORM_TAKES_DTYPE"))
    assert "ScalarType? dtype" in schema, moved(f"_foreach_norm's schema is {schema}", "FOREACH_NORM_TAKES_DTYPE")
    assert compat.FOREACH_NORM_TAKES_DTYPE
    norms = torch._foreach_norm([torch.ones(4, dtype=torch.float32)], dtype=torch.float64)
    assert norms[0].dtype == torch.float64 and norms[0].item() == 2.0, \
        moved("_foreach_norm(dtype=float64) no longer accumulates in float64", "FOREACH_NORM_TAKES_DTYPE")


def test_every_foreach_operation_called_exists_and_is_listed():
    missing = [name for name in compat.FOREACH_OPS if not hasattr(torch, name)]
    assert missing == [], moved(f"torch has no {missing}", "FOREACH_OPS")
    used = {m for path in SRC.rglob("*.py") for m in re.findall(r"torch\.(_foreach_[a-z_]+)", path.read_text())}
    assert used <= set(compat.FOREACH_OPS), f"list {sorted(used - set(compat.FOREACH_OPS))} in compat.FOREACH_OPS"


def test_the_muon_helpers_exist_and_give_muons_documented_values():
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("this torch has no Muon")
    from torch.optim import _muon

    for name in ("_zeropower_via_newtonschulz", "_adjust_lr"):
        assert hasattr(_muon, name), moved(f"torch.optim._muon.{name} is gone (the fallback runs)",
                                           "muon_orthogonalize / muon_lr_ratio")
    defaults = torch.optim.Muon([nn.Parameter(torch.zeros(3, 2))]).defaults
    coefficients, steps, eps = defaults["ns_coefficients"], defaults["ns_steps"], defaults["eps"]
    g = torch.Generator().manual_seed(0)
    for shape in ((3, 2), (2, 5), (4, 4)):
        update = torch.randn(*shape, generator=g)
        ortho = compat.muon_orthogonalize(update, coefficients, steps, eps)
        assert ortho.shape == update.shape and ortho.dtype == torch.bfloat16, \
            moved(f"Newton-Schulz of a {shape} matrix gave {tuple(ortho.shape)} {ortho.dtype}", "muon_orthogonalize")
        singular = torch.linalg.svdvals(ortho.float())
        assert bool(((singular > 0.3) & (singular < 1.7)).all()), \
            moved(f"Newton-Schulz no longer orthogonalizes (singular values {singular.tolist()})", "muon_orthogonalize")
        assert torch.equal(ortho, compat.newton_schulz(update, coefficients, steps, eps)), \
            moved("torch's Newton-Schulz differs from compat.newton_schulz, the fallback", "newton_schulz")
    for fn in (None, "original", "match_rms_adamw", "other"):
        for shape in ((3, 2), (2, 8), (5, 5)):
            expected = {"match_rms_adamw": 0.2 * math.sqrt(max(shape))}.get(fn, 1.0) if fn not in (None, "original") \
                else math.sqrt(max(1, shape[0] / shape[1]))
            assert compat.muon_lr_ratio(fn, torch.Size(shape)) == pytest.approx(expected, rel=1e-12), \
                moved(f"Muon's lr ratio for {fn} {shape} changed", "muon_lr_ratio")


def test_the_muon_fallback_ratio_is_torchs(monkeypatch):
    monkeypatch.setattr(compat, "_muon_module", lambda: None)
    assert compat.muon_lr_ratio(None, (8, 2)) == 2.0
    assert compat.muon_lr_ratio("match_rms_adamw", (4, 9)) == pytest.approx(0.6)
    update = torch.randn(3, 2)
    assert torch.equal(compat.muon_orthogonalize(update, (3.4445, -4.775, 2.0315), 5, 1e-7),
                       compat.newton_schulz(update, (3.4445, -4.775, 2.0315), 5, 1e-7))


@pytest.fixture
def one_process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        compat.forget_sharding_cache()


def test_fsdp_reduces_late_accumulated_gradients_through_its_param_groups(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    reference = copy.deepcopy(model)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), reshard_after_forward=False)
    state = fully_shard.state(model)
    for attribute in ("_state_ctx", "_fsdp_param_groups", "_root_post_backward_final_callback"):
        assert hasattr(state, attribute), moved(f"FSDP2's state has no {attribute}", "fsdp_reduce_gradients")
    assert state._fsdp_param_groups and all(hasattr(g, "post_backward") for g in state._fsdp_param_groups), \
        moved("FSDP2's param groups are gone or lost post_backward", "fsdp_reduce_gradients")
    model.set_is_last_backward(False)
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)
    x = torch.randn(5, 4)
    for _ in range(2):  # two micro-batches' backwards, reduced once afterwards
        model(x).sum().backward()
        reference(x).sum().backward()
    model.set_is_last_backward(True)
    model.set_reshard_after_backward(True)
    model.set_requires_gradient_sync(True)
    compat.fsdp_reduce_gradients(model)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, moved(f"no sharded gradient for {name} after the late reduction",
                                         "fsdp_reduce_gradients")
        torch.testing.assert_close(p.grad.to_local(), q.grad, msg=moved(
            f"the late reduction gave {name} another gradient", "fsdp_reduce_gradients"))


def test_fsdp_names_the_streams_its_all_gathers_read_the_shards_on(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Linear(4, 3)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    assert compat.fsdp_gather_streams(model) == [], moved("FSDP2 has streams before its first forward",
                                                           "fsdp_gather_streams")
    model(torch.randn(2, 4)).sum().backward()
    streams = compat.fsdp_gather_streams(model)
    assert streams is not None and len(streams) == 2, moved("FSDP2's all-gather streams are gone",
                                                            "fsdp_gather_streams")
    assert all(hasattr(s, "wait_event") for s in streams), moved("FSDP2's streams cannot wait on an event",
                                                                 "fsdp_gather_streams")


def test_the_sharding_cache_can_be_cleared():
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # noqa: F401
    except ImportError:
        pytest.fail(moved("torch.distributed.tensor.debug._clear_sharding_prop_cache is gone",
                          "forget_sharding_cache"))
    compat.forget_sharding_cache()


def test_a_tensors_version_rises_with_an_in_place_change():
    t = torch.zeros(3)
    assert hasattr(t, "_version"), moved("Tensor._version is gone", "tensor_version")
    before = compat.tensor_version(t)
    t.add_(1)
    assert compat.tensor_version(t) != before and compat.tensor_version(t) == compat.tensor_version(t), \
        moved("Tensor._version no longer changes with an in-place write", "tensor_version")


def test_a_compile_backend_is_looked_up_by_name():
    backend = compat.compile_backend("eager")
    assert callable(backend), moved("torch._dynamo.lookup_backend('eager') is not callable", "compile_backend")
    with pytest.raises(ValueError, match="no backend"):
        compat.compile_backend("no-such-backend")


def test_an_exported_graph_has_the_guard_and_assertion_nodes_graph_split_leaves_out():
    class ToDouble(nn.Module):
        def forward(self, x):
            return x.to(torch.float64).sum()

    graph = torch.export.export(ToDouble(), (torch.randn(2, 3),)).module().graph
    modules = [n.target for n in graph.nodes if n.op == "call_module"]
    functions = [n.target for n in graph.nodes if n.op == "call_function"]
    assert compat.ASSERTION_OPS, moved("aten._assert_tensor_metadata is gone", "ASSERTION_OPS")
    assert any(f in compat.ASSERTION_OPS for f in functions), \
        moved(f"an exported .to(dtype) no longer asserts its metadata with ASSERTION_OPS ({functions})", "ASSERTION_OPS")
    assert compat.EXPORT_GUARD_MODULE in modules, \
        moved(f"torch.export's input guard is no longer the submodule _guards_fn ({modules})", "EXPORT_GUARD_MODULE")


def test_pytree_flattens_and_rebuilds_what_export_records():
    from torch.utils import _pytree

    structure = ({"a": torch.zeros(1), "b": (1, 2)}, [3])
    leaves, spec = _pytree.tree_flatten(structure)
    assert compat.tree_leaves(structure) == leaves
    rebuilt = compat.tree_unflatten(leaves, spec)
    assert rebuilt[0]["b"] == (1, 2) and rebuilt[1] == [3], moved("pytree no longer round-trips", "tree_unflatten")


def test_the_walk_of_nested_values_keeps_their_order_and_their_types():
    """What runtime/values.py, microbatch.py, held.py, wire.py and profile.py rely on: a dict's
    values in its order, None and other leaves passed through, namedtuples and ModelOutputs
    rebuilt as themselves, equal structures equal (and hashable)."""
    from collections import namedtuple

    from transformers.modeling_outputs import CausalLMOutput

    pair = namedtuple("pair", "x y")
    a, b, c = torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)
    value = ({"b": a, "a": (b, None, 3)}, [pair(c, "s")], CausalLMOutput(logits=a))
    assert [t.numel() for t in compat.tensor_leaves(value)] == [1, 2, 3, 1], \
        moved("pytree's leaf order changed", "tensor_leaves")
    doubled = compat.tree_map_tensors(lambda t: t * 2, value)
    assert type(doubled[1][0]) is pair and type(doubled[2]) is CausalLMOutput and doubled[0]["a"][1:] == (None, 3), \
        moved("pytree no longer rebuilds a namedtuple or a ModelOutput", "tree_map_tensors")
    assert torch.equal(doubled[2].logits, 2 * a) and compat.tree_map_tensors(lambda t: t * 2, b).equal(2 * b)
    leaves, spec = compat.tree_flatten(value)
    again = compat.tree_flatten(compat.tree_unflatten(leaves, spec))[1]
    assert again == spec and hash(again) == hash(spec), \
        moved("a TreeSpec is no longer hashable", "tree_flatten")


def test_no_other_module_touches_a_private_name_of_torch():
    """compat.py is the one module that names a private API of torch (the multi-tensor family
    excepted, see FOREACH_OPS)."""
    private = re.compile(r"\btorch\.(?!_foreach_)(?:[A-Za-z_.]*\.)?_[a-z]|from torch[\w.]* import _|\._(?:cdata|version|"
                         r"swap_data_ptr_|fsdp_param_groups|state_ctx|schema)\b|_guards_fn")
    found = []
    for path in SRC.rglob("*.py"):
        if path.name == "compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if private.search(code) and not code.lstrip().startswith(("#", '"', "'", "``", ":")):
                found.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert found == [], "move these behind pipeoptim/compat.py:\n" + "\n".join(found)
