"""Trained models out of the framework: RUN_DIR/hf/ loads without sdp, and computes what the
run's evaluated model (model.pt) computes."""

import json

import timm
import torch
import transformers
from omegaconf import OmegaConf
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import nn
from torchvision.models import resnet

from sdp import export
from sdp.config import to_typed, typed_config
from sdp.data import data_tokenizer_file, prepare_data
from sdp.data.tokenizer import train_bpe, wrap_tokenizer
from sdp.models import build_model
from sdp.redact import redact_yaml
from sdp.rundir.export import export_tokenizer


def fake_run(tmp_path, overrides: list[str]):
    """A run dir as a finished run leaves it: config.yaml and a model.pt of trained-looking weights."""
    raw, cfg = typed_config(overrides)
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # not the initialisation: every weight must arrive
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(redact_yaml(raw))
    torch.save(model.state_dict(), run_dir / "model.pt")
    return run_dir, model


def test_a_llama_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    run_dir, model = fake_run(tmp_path, ["model=llama_tiny", "dataset=synthetic_text"])
    assert export.main([str(run_dir)]) == 0
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf", local_files_only=True).eval()
    assert type(loaded) is transformers.LlamaForCausalLM
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits)


def test_a_text_runs_tokenizer_goes_with_it_and_encodes_as_the_run_did(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x * {j}\n\n" for j in range(30)))
    data = [f"dataset.path={corpus}", f"dataset.cache_dir={tmp_path / 'cache'}", "dataset.vocab_size=300"]
    run_dir, model = fake_run(tmp_path, ["model=llama_tiny", "dataset=local_text", "dataset.eval_every=4", *data])
    cfg = to_typed(OmegaConf.load(run_dir / "config.yaml"))
    prepare_data(cfg.dataset)  # the tokenizer the run trained and cached
    assert export.main([str(run_dir)]) == 0
    names = sorted(p.name for p in (run_dir / "hf").iterdir())
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(names)
    ours = wrap_tokenizer(Tokenizer.from_file(str(data_tokenizer_file(cfg.dataset))), eos_token=None)
    theirs = transformers.AutoTokenizer.from_pretrained(run_dir / "hf", local_files_only=True)
    text = "def g(x):\n    return x * 7  # <|endoftext|> spelled in a comment is text\n"
    ids = ours.tokenizer.encode(text, add_special_tokens=False).ids
    assert theirs(text, add_special_tokens=False).input_ids == ids and theirs.eos_token_id == ours.eos_id
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf", local_files_only=True).eval()
    tokens = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits)


def test_a_tokenizer_with_ids_beyond_the_model_is_not_exported(tmp_path, capsys):
    path = tmp_path / "tokenizer.json"
    train_bpe(iter(["def f(x): return x\n"] * 50), vocab_size=300).tokenizer.save(str(path))
    assert not export_tokenizer(tmp_path, path, eos_token=None, vocab_size=10)
    assert "is not exported: its" in capsys.readouterr().err and not (tmp_path / "tokenizer_config.json").exists()


def test_a_resnet_builds_from_torchvision_with_its_builder_json(tmp_path):
    run_dir, model = fake_run(tmp_path, ["model=resnet_tiny", "dataset=synthetic_image"])
    assert export.main([str(run_dir)]) == 0
    spec = json.loads((run_dir / "hf" / "builder.json").read_text())
    assert spec["library"] == "torchvision" and spec["class"] == "torchvision.models.resnet.ResNet"
    rebuilt = resnet.ResNet(resnet.BasicBlock, spec["layers"], num_classes=spec["num_classes"])
    rebuilt.conv1 = nn.Conv2d(**spec["conv1"])
    if spec["maxpool"] == "identity":
        rebuilt.maxpool = nn.Identity()
    rebuilt.load_state_dict(load_file(run_dir / "hf" / "model.safetensors"), strict=True)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(images), model(images))


def test_a_swin_builds_from_timm_with_its_builder_json(tmp_path):
    run_dir, model = fake_run(tmp_path, ["model=swin_tiny", "dataset=synthetic_image"])
    assert export.main([str(run_dir)]) == 0
    spec = json.loads((run_dir / "hf" / "builder.json").read_text())
    assert spec["library"] == "timm"
    rebuilt = timm.create_model(spec["name"], **spec["kwargs"])
    rebuilt.load_state_dict(load_file(run_dir / "hf" / "model.safetensors"), strict=True)
    size = OmegaConf.load(run_dir / "config.yaml").model.img_size
    images = torch.randn(2, 3, size, size)
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(images), model(images))


def test_a_run_dir_without_a_model_is_one_error_line(tmp_path, capsys):
    assert export.main([str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err
        == f"error: RUN_DIR='{tmp_path}': has no model.pt (a finished run with trainer.save_model=true)\n"
    )
