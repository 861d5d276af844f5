"""Forward masking builds a physically smaller model that computes the masked full model."""

import pytest
import torch
from conftest import TINY_MODELS, tiny_model_cfg

from sdp.models import build_model
from sdp.subnet import MaskingConfig
from sdp.subnet.apply import apply_forward_masking, fold_eval_scaling
from sdp.subnet.plan import plan_mask


def _plain(family: str):
    torch.manual_seed(0)
    model = build_model(tiny_model_cfg(family)).train()
    with torch.no_grad():  # non-trivial biases and norms, so that a wrongly kept slice would show
        for name, p in model.named_parameters():
            if name.endswith("bias") or p.dim() == 1:
                p.normal_(std=0.1)
    return model


def _out(model, x):
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def _input(family: str):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 4096, (2, 16), generator=g) if family == "llama" else torch.randn(4, 3, 32, 32, generator=g)


@pytest.mark.parametrize("family", TINY_MODELS)
@pytest.mark.parametrize("gran", ["neuron", "block"])
@pytest.mark.parametrize("rank", [0, 3])
def test_submodel_equals_full_model_with_dropped_units_zeroed(family, gran, rank):
    """K = 4, C = 0.5: the submodel of `rank` against the full model whose non-held units are all zeros
    (a zeroed neuron contributes nothing; a zeroed block's branch outputs zero, so the block is its skip path)."""
    masking = MaskingConfig(name="forward", granularity=gran, coverage=0.5, scale="none")
    full = _plain(family)
    sub = _plain(family)
    spec, mask = plan_mask(full, masking, family=family, world_size=4)
    tensors = dict(full.named_parameters())
    with torch.no_grad():
        for g, group in enumerate(spec.groups):
            dropped = sorted(set(range(group.num_units)) - set(mask.held_units(rank, g).tolist()))
            for s in group.slices:
                if s.name not in tensors or not dropped:
                    continue
                if s.dim is None:
                    tensors[s.name].zero_()
                else:
                    tensors[s.name].index_fill_(s.dim, s.unit_positions(torch.tensor(dropped)), 0.0)
    apply_forward_masking(sub, *plan_mask(sub, masking, family=family, world_size=4), rank=rank, scale="none")
    x = _input(family)
    torch.testing.assert_close(_out(sub, x), _out(full, x), rtol=1e-5, atol=1e-5)
    n_sub, n_full = (sum(p.numel() for p in m.parameters()) for m in (sub, full))
    assert n_sub < n_full  # physically smaller: the dropped units are not allocated


def test_inverse_coverage_scales_each_site_by_units_over_held():
    masking = MaskingConfig(name="forward", granularity="neuron", coverage=0.5)
    plain, scaled = _plain("resnet"), _plain("resnet")
    apply_forward_masking(plain, *plan_mask(plain, masking, family="resnet", world_size=4), rank=1, scale="none")
    apply_forward_masking(
        scaled, *plan_mask(scaled, masking, family="resnet", world_size=4), rank=1, scale="inverse_coverage"
    )
    x = _input("resnet")
    stem = plain.maxpool(plain.relu(plain.bn1(plain.conv1(x))))  # shared: the same in both models

    def branch(model):
        block = model.layer1[0]
        return block.conv2(torch.relu(block.bn1(block.conv1(stem))))

    a, b = branch(plain), branch(scaled)
    torch.testing.assert_close(b, a * 2.0)  # 64 channels, 32 held


def test_batchnorm_recalibration_recomputes_statistics(tmp_path):
    """After recalibration the running mean is the mean over all calibration samples of the model
    as evaluated (its dropout off), and momentum and every module's mode are kept."""
    import torch.distributed as dist

    from sdp.run.trainer import recalibrate_batchnorm

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        conv = torch.nn.Conv2d(3, 4, 1, bias=False)
        model = torch.nn.Sequential(conv, torch.nn.Dropout(0.5), torch.nn.BatchNorm2d(4)).eval()
        bn = model[2]
        bn.running_mean.fill_(7.0)
        g = torch.Generator().manual_seed(0)
        batches = [{"inputs": torch.randn(8, 3, 5, 5, generator=g) + i} for i in range(3)]
        recalibrate_batchnorm(model, iter(batches), count=3, device=torch.device("cpu"))
        with torch.no_grad():
            features = conv(torch.cat([b["inputs"] for b in batches]))
        torch.testing.assert_close(bn.running_mean, features.mean(dim=(0, 2, 3)), rtol=1e-5, atol=1e-6)
        assert bn.momentum == 0.1 and not any(m.training for m in model.modules())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "family,capacity,shares",
    [(f, None, [0.5] * 4) for f in TINY_MODELS] + [("llama", [1, 0.5, 0.5, 0.5], [0.75, 0.75, 0.5, 0.5])],
)
def test_folded_eval_scaling_equals_scaling_the_site_outputs(family, capacity, shares):
    """eval_coverage is folded into the output modules' weights: the plain model then computes
    the full model with every block branch's output x the share of workers that hold the block
    (C; with capacities [1, 0.5, 0.5, 0.5], 3 or 2 of the 4 workers)."""
    masking = MaskingConfig(name="forward", granularity="block", coverage=0.5, capacity=capacity)
    hooked, folded = _plain(family).eval(), _plain(family).eval()
    spec, mask = plan_mask(hooked, masking, family=family, world_size=4)
    assert [len(mask.unit_holders(g)[0]) / 4 for g in range(len(spec.groups))] == shares
    for group, share in zip(spec.groups, shares, strict=True):
        for out in group.outputs:
            hooked.get_submodule(out).register_forward_hook(lambda mod, args, output, s=share: output * s)
    fold_eval_scaling(folded, spec, mask)
    x = _input(family)
    torch.testing.assert_close(_out(folded, x), _out(hooked, x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(_out(folded, x), _out(_plain(family).eval(), x))


# (family, K, C) where K divides every unit group of the tiny model at C (llama_tiny has 2 KV groups).
DENSE_CONTROLS = [("llama", 2, 0.5), ("resnet", 4, 0.5), ("resnet", 4, 0.75), ("swin", 2, 0.5)]


def _narrow_resnet(base_width: int):
    """resnet_tiny with stages of base_width x (1, 2, 4, 8) channels."""
    cfg = tiny_model_cfg("resnet")
    cfg.base_width = base_width
    return cfg


def test_a_resnets_base_width_sets_every_stage_and_the_stem():
    model = build_model(_narrow_resnet(16))
    assert model.conv1.out_channels == model.bn1.num_features == 16
    stages = [model.layer1, model.layer2, model.layer3, model.layer4]
    assert [s[0].conv2.out_channels for s in stages] == [16, 32, 64, 128] and model.fc.in_features == 128
    assert model(torch.randn(2, 3, 28, 28)).shape == (2, 10)


@pytest.mark.parametrize("family, workers, coverage", DENSE_CONTROLS)
def test_the_dense_control_is_the_forward_masked_subnetwork(family, workers, coverage):
    """model.inner_width=C builds, for every worker, a model with the tensors of N-SDP forward's
    subnetwork at coverage C (names and shapes), which computes what the subnetwork computes
    given its weights: the same-size dense control trains exactly the subnetwork's architecture."""
    cfg = tiny_model_cfg(family)
    cfg.inner_width = coverage
    dense = build_model(cfg).train()
    masking = MaskingConfig(name="forward", granularity="neuron", coverage=coverage, scale="none")
    x = _input(family)
    for rank in range(workers):
        sub = _plain(family)
        apply_forward_masking(sub, *plan_mask(sub, masking, family=family, world_size=workers), rank=rank, scale="none")
        shapes = {name: t.shape for name, t in sub.state_dict().items()}
        assert {name: t.shape for name, t in dense.state_dict().items()} == shapes
        dense.load_state_dict(sub.state_dict(), strict=True)
        assert torch.equal(_out(dense, x), _out(sub, x))
