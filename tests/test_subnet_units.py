"""Unit specs: the slices of a unit belong together, and units tile their tensors."""

import pytest
import torch
from conftest import TINY_MODELS, tiny_model_cfg

from sdp.models import build_model
from sdp.subnet.units import unit_spec


def _model(family: str):
    torch.manual_seed(0)
    model = build_model(tiny_model_cfg(family)).eval()
    with torch.no_grad():  # fresh biases and BatchNorms are constant: a permutation could not show on them
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5), m.bias.normal_(), m.running_mean.normal_(), m.running_var.uniform_(0.5, 2)
            elif isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(std=0.1)
    return model


def _input(family: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    if family == "llama":
        return torch.randint(0, 4096, (2, 16), generator=g)
    return torch.randn(2, 3, 32, 32, generator=g)


def _logits(model, x):
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("family", TINY_MODELS)
@pytest.mark.parametrize("granularity", ["neuron", "block"])
def test_units_and_shared_tensors_partition_the_model(family, granularity):
    model = _model(family)
    spec = unit_spec(model, family=family, granularity=granularity)
    tensors = dict(model.named_parameters()) | {n: b for n, b in model.named_buffers() if b is not None}
    owned = spec.unit_tensor_names()
    assert owned.isdisjoint(spec.shared_params)
    assert owned | set(spec.shared_params) >= set(dict(model.named_parameters()))
    for group in spec.groups:
        for s in group.slices:
            if s.dim is None:
                assert group.num_units == 1
                continue
            # The units of a group tile the sliced dimension exactly once.
            assert s.index.shape[0] == group.num_units
            assert sorted(s.index.flatten().tolist()) == list(range(tensors[s.name].shape[s.dim])), s.name


@pytest.mark.parametrize("family", TINY_MODELS)
def test_permuting_units_leaves_the_function_unchanged(family):
    """If a slice were missing from a unit, or indexed wrongly, a permutation of the
    units (applied to every slice of the group) would change the output."""
    model = _model(family)
    x = _input(family)
    before = _logits(model, x)
    spec = unit_spec(model, family=family, granularity="neuron")
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    g = torch.Generator().manual_seed(2)
    permuted_groups = 0
    with torch.no_grad():
        for group in spec.groups:
            if group.num_units < 2:
                continue
            perm = torch.randperm(group.num_units, generator=g)
            for s in group.slices:
                source = s.index[perm].reshape(-1)  # new unit u takes old unit perm[u]
                target = s.index.reshape(-1)
                t = tensors[s.name]
                t.index_copy_(s.dim, target, t.index_select(s.dim, source).clone())
            permuted_groups += 1
    assert permuted_groups >= 4
    torch.testing.assert_close(_logits(model, x), before, rtol=1e-4, atol=1e-5)


def test_llama_heads_follow_gqa_groups():
    model = _model("llama")
    spec = unit_spec(model, family="llama", granularity="neuron")
    heads = next(g for g in spec.groups if g.kind == "heads")
    by_name = {s.name.rsplit(".", 2)[-2]: s for s in heads.slices}
    assert heads.num_units == 2  # llama_tiny: 4 query heads sharing 2 KV heads
    assert by_name["q_proj"].index.shape == (2, 2 * 32) and by_name["k_proj"].index.shape == (2, 32)


def test_block_units_keep_shortcuts_shared():
    model = _model("resnet")
    spec = unit_spec(model, family="resnet", granularity="block")
    assert len(spec.groups) == 4
    assert "layer2.0.downsample.0.weight" in spec.shared_params
    assert "conv1.weight" in spec.shared_params and "fc.weight" in spec.shared_params
