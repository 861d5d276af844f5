"""Trained models out of the framework: RUN_DIR/hf/ loads without sdp, and computes what the
run's evaluated model (model.pt) computes."""

import gzip
import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import transformers
from omegaconf import OmegaConf
from PIL import Image
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from torch import nn
from torchvision.models import resnet

from sdp import export
from sdp.data import DataConfig, build_data, data_tokenizer_file, fashion_mnist, prepare_data, synthetic
from sdp.data.api import DATASETS
from sdp.data.image_folder import eval_transform
from sdp.data.tokenizer import train_bpe, wrap_tokenizer
from sdp.models import build_model
from sdp.run.config import record_yaml, to_typed, typed_config
from sdp.rundir.hf import export_model, hf_tokenizer, image_preprocessing, special_tokens

DOC = Path(__file__).parents[1] / "docs" / "export.md"
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
CODE = "".join(f'def f{j}(x):\n    return x * {j}  # "quoted"!\n\n' for j in range(30))


def fake_run(tmp_path, overrides: list[str]):
    """A run dir as a finished run leaves it: config.yaml and a model.pt of trained-looking weights."""
    cfg = typed_config(overrides)
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # not the initialisation: every weight must arrive
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(record_yaml(cfg))
    torch.save(model.state_dict(), run_dir / "model.pt")
    return run_dir, model


# model.inner_width: 1 is the model as configured, 0.5 the dense control of N-SDP at C = 0.5.
WIDTHS = ["model.inner_width=1.0", "model.inner_width=0.5"]


@pytest.mark.parametrize("width", WIDTHS)
def test_a_llama_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, width):
    run_dir, model = fake_run(tmp_path, ["model=llama_tiny", "dataset=synthetic_text", width])
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
    assert hf_tokenizer(path, eos_token=None, vocab_size=10, max_length=512) is None
    assert "is not exported: its" in capsys.readouterr().err


def test_without_a_tokenizer_the_model_names_no_special_ids(tmp_path, capsys):
    """Not transformers' defaults (1 and 2, ordinary tokens of ours): none, so generate() runs
    to its length rather than stopping at a token that is no end of text."""
    run_dir, _ = fake_run(tmp_path, ["model=llama_tiny", "model.vocab_size=256", "dataset=synthetic_text"])
    path = tmp_path / "tokenizer.json"
    train_bpe(iter([CODE] * 50), vocab_size=300).tokenizer.save(str(path))
    cfg = to_typed(OmegaConf.load(run_dir / "config.yaml"))
    export_model(run_dir, cfg.model, tokenizer=path, eos_token=None)
    assert "is not exported: its 300 ids exceed the model's 256" in capsys.readouterr().err
    hf = run_dir / "hf"
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    config = json.loads((hf / "config.json").read_text())
    generation = json.loads((hf / "generation_config.json").read_text())
    assert [config[key] for key in SPECIAL_IDS] == [None, None, None]
    assert [key for key in SPECIAL_IDS if key in generation] == []


@pytest.mark.parametrize("width", [*WIDTHS, "model.base_width=16"])
def test_a_resnet_builds_from_torchvision_with_its_builder_json(tmp_path, width):
    run_dir, model = fake_run(tmp_path, ["model=resnet_tiny", "dataset=synthetic_image", width])
    assert export.main([str(run_dir)]) == 0
    spec = json.loads((run_dir / "hf" / "builder.json").read_text())
    assert spec["library"] == "torchvision" and spec["class"] == "torchvision.models.resnet.ResNet"
    rebuilt = resnet.ResNet(resnet.BasicBlock, spec["layers"], num_classes=spec["num_classes"])
    base = spec["base_width"]
    if base != 64:  # builder.json's recipe for other stage widths
        rebuilt.inplanes, rebuilt.bn1 = base, nn.BatchNorm2d(base)
        for i, blocks in enumerate(spec["layers"]):
            stage = rebuilt._make_layer(resnet.BasicBlock, base * 2**i, blocks, stride=1 if i == 0 else 2)
            setattr(rebuilt, f"layer{i + 1}", stage)
        rebuilt.fc = nn.Linear(8 * base, spec["num_classes"])
    rebuilt.conv1 = nn.Conv2d(**spec["conv1"])
    if spec["maxpool"] == "identity":
        rebuilt.maxpool = nn.Identity()
    stages = [rebuilt.layer1, rebuilt.layer2, rebuilt.layer3, rebuilt.layer4]
    for stage, inner in zip(stages, spec["inner_channels"], strict=True):
        for block in stage:  # builder.json's recipe, where the inner channels differ from the stage's
            if inner != block.conv2.out_channels:
                block.conv1 = nn.Conv2d(block.conv1.in_channels, inner, 3, block.conv1.stride, 1, bias=False)
                block.bn1 = nn.BatchNorm2d(inner)
                block.conv2 = nn.Conv2d(inner, block.conv2.out_channels, 3, 1, 1, bias=False)
    rebuilt.load_state_dict(load_file(run_dir / "hf" / "model.safetensors"), strict=True)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(images), model(images))


@pytest.mark.parametrize("width", WIDTHS)
def test_a_swin_builds_from_timm_with_its_builder_json(tmp_path, width):
    run_dir, model = fake_run(tmp_path, ["model=swin_tiny", "dataset=synthetic_image", width])
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


@pytest.mark.parametrize(
    "name, text, error",
    [
        ("config.yaml", "\x00", "cannot be read as YAML (ReaderError"),
        ("config.yaml", "model: 3\n", "is not a run's config (AttributeError"),
        ("config.yaml", "- a list\n", "holds list, not a mapping of config keys"),
        ("model.pt", "PK not a zip", "cannot be loaded (RuntimeError"),
    ],
)
def test_a_damaged_run_dir_file_is_one_error_line(name, text, error, tmp_path, capsys):
    # Before: a corrupt config.yaml or model.pt ended the export in a traceback.
    run_dir, _ = fake_run(tmp_path, ["model=resnet_tiny", "dataset=synthetic_image"])
    (run_dir / name).write_text(text)
    assert export.main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run_dir / name}: {error}") and err.count("\n") == 1, err
    assert not (run_dir / "hf").exists()


# ---------------------------------------------------------------- LLaMA: what other tools read


def llama_with_tokenizer(tmp_path):
    """A LLaMA run dir exported as the runner exports it, with a byte-level BPE tokenizer (its end
    of text, <|endoftext|>, is id 0; ids 1 and 2, transformers' default bos and eos, are "!" and
    the quote mark); returns the run dir, the run's model and the tokenizer.json."""
    run_dir, model = fake_run(tmp_path, ["model=llama_tiny", "dataset=synthetic_text"])
    path = tmp_path / "tokenizer.json"
    train_bpe(iter([CODE] * 50), vocab_size=300).tokenizer.save(str(path))
    cfg = to_typed(OmegaConf.load(run_dir / "config.yaml"))
    export_model(run_dir, cfg.model, tokenizer=path, eos_token=None)
    return run_dir, model, path


def test_the_llama_config_names_transformers_class_and_the_tokenizers_own_special_ids(tmp_path):
    run_dir, model, path = llama_with_tokenizer(tmp_path)
    hf = run_dir / "hf"
    config = json.loads((hf / "config.json").read_text())
    generation = json.loads((hf / "generation_config.json").read_text())
    ours = wrap_tokenizer(Tokenizer.from_file(str(path)), eos_token=None)
    theirs = transformers.AutoTokenizer.from_pretrained(hf, local_files_only=True)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert ours.eos_id == 0 and ours.tokenizer.id_to_token(0) == "<|endoftext|>"
    ids = [theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id]
    assert ids == [ours.eos_id] * 3
    assert [config[key] for key in SPECIAL_IDS] == ids and [generation[key] for key in SPECIAL_IDS] == ids
    assert theirs.all_special_ids == [0] and theirs.all_special_tokens == ["<|endoftext|>"]
    assert theirs.model_max_length == config["max_position_embeddings"] == model.config.max_position_embeddings
    assert config["max_position_embeddings"] == 512  # llama_tiny's model.max_seq_len


def test_the_tokenizer_config_names_a_class_transformers_4_loads(tmp_path):
    """5.x writes its internal TokenizersBackend (and a `backend` key), which 4.x's AutoTokenizer
    refuses; both know PreTrainedTokenizerFast. (Checked by hand with transformers 4.46.3.)"""
    run_dir, _, path = llama_with_tokenizer(tmp_path)
    config = json.loads((run_dir / "hf" / "tokenizer_config.json").read_text())
    assert config == {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "model_max_length": 512,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": True,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    theirs = transformers.AutoTokenizer.from_pretrained(run_dir / "hf", local_files_only=True)
    ours = wrap_tokenizer(Tokenizer.from_file(str(path)), eos_token=None)
    text = 'def g(x):\n    return "x" + "!"  # <|endoftext|> spelled in a comment is text\n'
    assert theirs(text).input_ids == ours.tokenizer.encode(text, add_special_tokens=False).ids


def test_a_tokenizer_with_its_own_beginning_of_text_keeps_it_as_bos():
    """LLaMA-2 style special tokens: <s> begins, </s> ends (and pads), <unk> stands in."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    bpe.train_from_iterator([CODE] * 5, trainer=trainer)
    names = special_tokens(wrap_tokenizer(bpe, eos_token=None))
    assert names == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>", "unk_token": "<unk>"}


class EndOfTextAt(transformers.LogitsProcessor):
    """Makes `eos` the most likely next token at generated step `step` (0-based) only, beating the
    model's own best by 1, and forbids it before: generate() must stop there, by itself."""

    def __init__(self, eos: int, *, step: int, prompt_len: int):
        self.eos, self.at = eos, prompt_len + step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[:, self.eos] = scores.max() + 1 if input_ids.shape[1] == self.at else -float("inf")
        return scores


def test_generate_stops_at_the_tokenizers_end_of_text(tmp_path):
    run_dir, _, _ = llama_with_tokenizer(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf", local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(run_dir / "hf", local_files_only=True)
    prompt = tok("def f(x):", return_tensors="pt")
    n = prompt.input_ids.shape[1]
    force = transformers.LogitsProcessorList([EndOfTextAt(tok.eos_token_id, step=3, prompt_len=n)])
    with torch.no_grad():
        out = loaded.generate(**prompt, max_new_tokens=20, do_sample=False, logits_processor=force)
    assert out.shape == (1, n + 4) and out[0, -1].item() == tok.eos_token_id == 0
    assert 0 not in out[0, n:-1].tolist()


def test_the_export_draws_no_progress_bar_and_leaves_transformers_bars_alone(tmp_path, capfd):
    fake = fake_run(tmp_path, ["model=llama_tiny", "dataset=synthetic_text"])[0]
    export_model(fake, to_typed(OmegaConf.load(fake / "config.yaml")).model)
    assert capfd.readouterr() == ("", "")
    assert transformers.utils.logging.set_tqdm_hook(None) is None  # its hook was put back
    assert transformers.utils.logging.is_progress_bar_enabled()


# ---------------------------------------------------------------- vision: builder.json's preprocessing


def documented_fields(heading: str) -> set[str]:
    """The field names (backticked, first column) of the first table after the line `heading` in
    docs/export.md."""
    lines = DOC.read_text().splitlines()
    rows = itertools.dropwhile(lambda line: not line.startswith("|"), lines[lines.index(heading) + 1 :])
    table = list(itertools.takewhile(lambda line: line.startswith("|"), rows))[2:]
    return {name for row in table for name in re.findall(r"`([^`]+)`", row.split("|")[1])}


def doc_prepare():
    """The `prepare(image, preprocessing)` function docs/export.md gives users, run as written."""
    code = re.search(r"```python\n(import numpy as np\n.*?)```", DOC.read_text(), re.S).group(1)
    namespace = {}
    exec(code, namespace)  # noqa: S102 - the documentation's own example, from this repository
    return namespace["prepare"]


def write_fashion_mnist(directory: Path, images: dict[str, np.ndarray]) -> None:
    """The four IDX files of a Fashion-MNIST with these uint8 [N, 28, 28] images per split."""
    for split, (images_file, labels_file) in fashion_mnist.FILES.items():
        pixels = images[split]
        header = fashion_mnist.IMAGES_MAGIC.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in pixels.shape)
        with gzip.open(directory / images_file, "wb") as f:
            f.write(header + pixels.tobytes())
        with gzip.open(directory / labels_file, "wb") as f:
            f.write(fashion_mnist.LABELS_MAGIC.to_bytes(4, "big") + len(pixels).to_bytes(4, "big") + bytes(len(pixels)))


def test_a_resnet_on_fashion_mnist_says_how_its_images_were_prepared(tmp_path):
    """builder.json's preprocessing, applied outside sdp (docs/export.md's prepare) to the dataset's
    own 28x28 grey images, gives the inputs the run evaluated, and the rebuilt model its outputs."""
    rng = np.random.default_rng(0)
    raw = {split: rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8) for split, n in (("train", 4), ("eval", 3))}
    (tmp_path / "fmnist").mkdir()
    write_fashion_mnist(tmp_path / "fmnist", raw)
    run_dir, model = fake_run(
        tmp_path, ["model=resnet_tiny", "dataset=fashion_mnist", f"dataset.path={tmp_path / 'fmnist'}"]
    )
    assert export.main([str(run_dir)]) == 0
    spec = json.loads((run_dir / "hf" / "builder.json").read_text())
    data = to_typed(OmegaConf.load(run_dir / "config.yaml")).dataset
    assert spec["preprocessing"] == {
        "dataset": "fashion_mnist",
        "color_mode": "L",
        "in_channels": 3,
        "image_size": data.image_size,
        "resize": None,
        "center_crop": None,
        "pad": fashion_mnist.PAD,
        "pixel_scale": 255,
        "mean": list(fashion_mnist.MEAN) * 3,
        "std": list(fashion_mnist.STD) * 3,
    }
    assert set(spec) == documented_fields("ResNet (`model.family=resnet`):")
    assert set(spec["preprocessing"]) == documented_fields("### `preprocessing`")
    prepare = doc_prepare()
    inputs = torch.stack([prepare(Image.fromarray(image), spec["preprocessing"]) for image in raw["eval"]])
    run = build_data(data, rank=0, world_size=1, batch_size=2, eval_batch_size=3, seed=0)
    assert torch.equal(inputs, next(iter(run.make_eval()))["inputs"])
    rebuilt = resnet.ResNet(resnet.BasicBlock, spec["layers"], num_classes=spec["num_classes"])
    rebuilt.conv1 = nn.Conv2d(**spec["conv1"])
    rebuilt.load_state_dict(load_file(run_dir / "hf" / "model.safetensors"), strict=True)
    assert rebuilt.conv1.in_channels == spec["preprocessing"]["in_channels"]
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(inputs), model(inputs))


def test_a_swin_on_synthetic_images_says_how_they_were_prepared_at_the_end_of_a_run_too(tmp_path):
    """The runner's call gives no dataset: the export reads the run dir's config.yaml."""
    run_dir, _ = fake_run(tmp_path, ["model=swin_tiny", "dataset=synthetic_image", "dataset.image_size=16"])
    cfg = to_typed(OmegaConf.load(run_dir / "config.yaml"))
    export_model(run_dir, cfg.model, tokenizer=data_tokenizer_file(cfg.dataset), eos_token=cfg.dataset.eos_token)
    from_runner = (run_dir / "hf" / "builder.json").read_text()
    assert export.main([str(run_dir)]) == 0
    assert (run_dir / "hf" / "builder.json").read_text() == from_runner
    spec = json.loads(from_runner)
    assert spec["preprocessing"] == {
        "dataset": "synthetic_image",
        "color_mode": "RGB",
        "in_channels": 3,
        "image_size": 16,
        "resize": None,
        "center_crop": None,
        "pad": 0,
        "pixel_scale": 255,
        "mean": list(synthetic.PIXEL_MEAN),
        "std": list(synthetic.PIXEL_STD),
    }
    assert spec["kwargs"]["img_size"] == cfg.dataset.image_size == 16
    assert set(spec) == documented_fields("Swin (`model.family=swin`):")
    rebuilt = timm.create_model(spec["name"], **spec["kwargs"])
    assert rebuilt.patch_embed.proj.in_channels == spec["preprocessing"]["in_channels"]


def test_imagenet_says_its_resize_and_crop_and_docs_prepare_matches_its_evaluation():
    preprocessing = image_preprocessing(DataConfig(name="imagenet", kind="image", image_size=64))
    assert preprocessing == {
        "dataset": "imagenet",
        "color_mode": "RGB",
        "in_channels": 3,
        "image_size": 64,
        "resize": {"shorter_side": 73, "interpolation": "bilinear", "antialias": True},  # round(64 * 256 / 224)
        "center_crop": 64,
        "pad": 0,
        "pixel_scale": 255,
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
    }
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, size=(90, 120, 3), dtype=np.uint8))
    assert torch.equal(doc_prepare()(image, preprocessing), eval_transform(64)(image))


def test_every_image_dataset_says_its_preprocessing():
    """A new image dataset must add its preprocessing to the export (ValueError until it does)."""
    names = sorted(name for name, spec in DATASETS.items() if spec.kind == "image")
    assert names == ["cifar10", "cifar100", "fashion_mnist", "imagenet", "synthetic_image"]
    for name in names:
        preprocessing = image_preprocessing(DataConfig(name=name, kind="image"))
        assert len(preprocessing["mean"]) == len(preprocessing["std"]) == preprocessing["in_channels"] == 3
    with pytest.raises(ValueError, match=r"^dataset.name='mnist': the export does not know its images' preprocessing$"):
        image_preprocessing(DataConfig(name="mnist", kind="image"))
