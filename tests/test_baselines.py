"""Dropout and stochastic-depth baselines: SDP's units dropped per sample, at keep rate C."""

import pytest
import torch
from conftest import TINY_MODELS, tiny_model_cfg

from sdp.errors import ConfigError
from sdp.models import build_model
from sdp.run.config import load_config
from sdp.run.trainer import forward_loss
from sdp.subnet.baselines import apply_unit_noise


def _batch(family: str, n: int = 16) -> dict:
    g = torch.Generator().manual_seed(0)
    if family == "llama":
        tokens = torch.randint(0, 4096, (n, 9), generator=g)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return {"inputs": torch.randn(n, 3, 32, 32, generator=g), "targets": torch.randint(0, 10, (n,), generator=g)}


def _fresh(family: str):
    torch.manual_seed(0)
    return build_model(tiny_model_cfg(family))


@pytest.mark.parametrize("kind", ["dropout", "stochastic_depth"])
@pytest.mark.parametrize("family", TINY_MODELS)
def test_keep_rate_one_and_evaluation_change_nothing(family, kind):
    # Fresh models for each comparison: a training forward moves BatchNorm statistics.
    batch = _batch(family)
    noisy, half = _fresh(family), _fresh(family)
    apply_unit_noise(noisy, family=family, kind=kind, keep=1.0)
    apply_unit_noise(half, family=family, kind=kind, keep=0.5)
    assert torch.equal(forward_loss(_fresh(family).eval(), batch)[0], forward_loss(half.eval(), batch)[0])
    assert torch.equal(forward_loss(_fresh(family).train(), batch)[0], forward_loss(noisy.train(), batch)[0])
    # And at C = 0.5 training does drop something.
    assert not torch.equal(forward_loss(_fresh(family).train(), batch)[0], forward_loss(half.train(), batch)[0])


def _capture(module, store: list, *, output: bool):
    if output:
        return module.register_forward_hook(lambda m, a, out: store.append(out.detach().clone()))
    return module.register_forward_pre_hook(lambda m, a: store.append(a[0].detach().clone()))


@pytest.mark.parametrize(
    "family,site,units",
    [("llama", "model.layers.0.mlp.down_proj", None), ("resnet", "layer1.0.conv2", None), ("llama", "o_proj", 4)],
)
def test_dropout_zeroes_whole_units_per_sample_and_rescales_the_rest(family, site, units):
    model = _fresh(family).train()
    site = "model.layers.0.self_attn.o_proj" if site == "o_proj" else site
    module = model.get_submodule(site)
    before, after = [], []
    _capture(module, before, output=False)  # runs before the dropout hook, sees the clean input
    apply_unit_noise(model, family=family, kind="dropout", keep=0.5)
    _capture(module, after, output=False)
    forward_loss(model, _batch(family))
    x, y = before[0], after[0]
    if family == "resnet":  # (B, channels, H, W): a unit is a channel
        x, y = x.flatten(2).transpose(1, 2), y.flatten(2).transpose(1, 2)
    n_units = units or x.shape[-1]
    # (B, positions, units, features per unit): every entry of a (sample, unit) scales alike.
    x = x.reshape(x.shape[0], -1, n_units, x.shape[-1] // n_units)
    y = y.reshape(x.shape)
    ratio = torch.where(x.abs() > 1e-6, y / x, torch.nan)
    per_unit = ratio.nanmean(dim=(1, 3))
    seen = ~ratio.isnan()
    assert torch.allclose(ratio[seen], per_unit[:, None, :, None].expand_as(ratio)[seen], atol=1e-5)
    kept = per_unit.nan_to_num(0.0)
    assert set(kept.unique().tolist()) <= {0.0, 2.0}
    assert 0.3 < (kept == 2.0).float().mean().item() < 0.7  # keep rate 0.5 (dozens of draws)
    assert not torch.equal(kept[0], kept[1]) or not torch.equal(kept[1], kept[2])  # per sample


@pytest.mark.parametrize("family", TINY_MODELS)
def test_stochastic_depth_drops_a_whole_residual_branch_per_sample(family):
    model = _fresh(family).train()
    outputs = {
        "llama": ["model.layers.1.self_attn.o_proj", "model.layers.1.mlp.down_proj"],
        "resnet": ["layer2.0.bn2"],
        "swin": ["layers.1.blocks.0.attn.proj", "layers.1.blocks.0.mlp.fc2"],
    }[family]
    before = {o: [] for o in outputs}
    for o in outputs:
        _capture(model.get_submodule(o), before[o], output=True)  # before ours: the clean outputs
    apply_unit_noise(model, family=family, kind="stochastic_depth", keep=0.5)
    after = {o: [] for o in outputs}
    for o in outputs:
        _capture(model.get_submodule(o), after[o], output=True)
    batch = _batch(family)
    forward_loss(model, batch)
    n = batch["inputs"].shape[0]
    factors = []
    for o in outputs:
        x, y = before[o][0], after[o][0]
        rows = y.shape[0] // n  # Swin's window attention: image-major rows of windows
        ratio = (y.reshape(n, -1) / x.reshape(n, -1).where(x.reshape(n, -1).abs() > 1e-6, torch.nan)).nanmean(1)
        assert rows >= 1 and set(ratio.round(decimals=4).tolist()) <= {0.0, 2.0}
        factors.append(ratio.round(decimals=4))
    assert all(torch.equal(f, factors[0]) for f in factors)  # the layer's branches drop together
    assert 0 < (factors[0] == 2.0).sum().item() < n


def test_baseline_configs_and_their_errors():
    base = ["model=llama_tiny", "dataset=synthetic_text"]
    cfg = load_config([*base, "variant=dropout", "masking.coverage=0.25"], world_size=8, offline=True)
    assert (cfg.masking.name, cfg.masking.coverage) == ("dropout", 0.25)
    cfg = load_config([*base, "variant=stochastic_depth", "trainer.protocol=flop_matched"], world_size=8, offline=True)
    assert cfg.masking.name == "stochastic_depth" and cfg.trainer.max_steps == 1000  # DDP compute: not rescaled
    with pytest.raises(ConfigError, match="masking=dropout has no mask to resample"):
        load_config([*base, "masking=dropout", "masking.resample_every=5"], world_size=8, offline=True)
    with pytest.raises(ConfigError, match=r"must be in \(0, 1\]"):
        load_config([*base, "masking=stochastic_depth", "masking.coverage=0"], world_size=8, offline=True)
