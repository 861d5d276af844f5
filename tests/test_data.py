"""Tests of sdp.data on small fixtures written in each dataset's real on-disk format."""

import gzip
import json
import pickle
from dataclasses import replace
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from sdp.data import DataConfig, build_data, data_vocab_size, local_text, prepare_data, validate_data
from sdp.data.core import cache_root
from sdp.data.images import random_crop_flip
from sdp.data.tokenizer import encode_docs, train_bpe
from sdp.errors import ConfigError
from sdp.paths import DamagedFile
from sdp.run.config import CONF_DIR

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def build(cfg: DataConfig, *, rank: int = 0, world_size: int = 1, batch_size: int = 4, eval_batch_size: int = 3):
    """build_data with the test's usual sizes and seed 0."""
    return build_data(
        cfg, rank=rank, world_size=world_size, batch_size=batch_size, eval_batch_size=eval_batch_size, seed=0
    )


def image_key(image: torch.Tensor, label: torch.Tensor) -> bytes:
    return image.numpy().tobytes()


def row_key(inputs: torch.Tensor, targets: torch.Tensor) -> tuple:
    return (*inputs.tolist(), int(targets[-1]))


def train_items(bundle, *, batches: int, key) -> list:
    """Identities of the samples in the first `batches` train batches."""
    items = []
    for batch in islice(bundle.train, batches):
        items += [key(*sample) for sample in zip(batch["inputs"], batch["targets"], strict=True)]
    return items


def eval_items(bundle, *, key) -> list:
    return [
        key(*sample) for batch in bundle.make_eval() for sample in zip(batch["inputs"], batch["targets"], strict=True)
    ]


def assert_partition(per_rank: list[list], *, total: int) -> None:
    """No sample twice on one rank or across ranks, and `total` samples in all."""
    union = set().union(*map(set, per_rank))
    assert sum(len(items) for items in per_rank) == len(union) == total


def expect_config_error(cfg: DataConfig, key: str, *, offline: bool = True, text: str = "") -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        validate_data(cfg, offline=offline)
    assert str(caught.value).startswith(f"{key}="), str(caught.value)
    assert text in str(caught.value)
    assert "\n" not in str(caught.value)
    return caught.value


# ---------------------------------------------------------------- config and generic checks


@pytest.mark.parametrize("path", sorted((CONF_DIR / "dataset").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_yaml_fills_a_data_config(path):
    raw = OmegaConf.load(path)
    assert {"name", "kind"} <= set(raw) and raw.name == path.stem
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), raw))
    assert isinstance(cfg, DataConfig)
    if cfg.name in ("synthetic_text", "synthetic_image", "local_text"):
        validate_data(cfg, offline=True)


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"kind": "audio"}, "dataset.kind"),
        ({"name": "mnist"}, "dataset.name"),
        ({"kind": "image"}, "dataset.kind"),
        ({"seq_len": 0}, "dataset.seq_len"),
        ({"vocab_size": 0}, "dataset.vocab_size"),
        ({"num_workers": -1}, "dataset.num_workers"),
        ({"eval_batches": -2}, "dataset.eval_batches"),
    ],
)
def test_bad_values_raise_config_error(changes, key):
    cfg = DataConfig(**{"name": "synthetic_text", "kind": "text", **changes})
    expect_config_error(cfg, key)


def test_batch_larger_than_shard_raises_config_error():
    cfg = DataConfig(name="synthetic_text", kind="text", num_samples=10)
    with pytest.raises(ConfigError, match=r"^trainer.global_batch_size='8 per rank': must be <= 5"):
        build(cfg, world_size=2, batch_size=8)


def test_cache_dir_defaults_to_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SDP_CACHE_DIR", str(tmp_path))
    assert cache_root(DataConfig(name="local_text", kind="text")) == tmp_path
    assert cache_root(DataConfig(name="local_text", kind="text", cache_dir="/x")) == Path("/x")


# ---------------------------------------------------------------- synthetic


def test_synthetic_text_shards_are_disjoint_and_cover_the_rows():
    cfg = DataConfig(name="synthetic_text", kind="text", seq_len=8, vocab_size=50, num_samples=64, num_eval_samples=21)
    batch = next(build(cfg).train)
    assert batch["inputs"].shape == batch["targets"].shape == (4, 8)
    assert batch["inputs"].dtype == batch["targets"].dtype == torch.int64
    assert torch.equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    bundles = [build(cfg, rank=r, world_size=2) for r in range(2)]
    assert_partition([train_items(b, batches=8, key=row_key) for b in bundles], total=64)
    evals = [eval_items(b, key=row_key) for b in bundles]
    assert_partition(evals, total=20)  # 21 rows: one dropped so both ranks run 10
    assert data_vocab_size(cfg) == bundles[0].vocab_size == 50


def test_train_reshuffles_each_epoch_and_repeats_forever():
    cfg = DataConfig(name="synthetic_text", kind="text", seq_len=4, num_samples=16)
    bundle = build(cfg, batch_size=4)
    epochs = [train_items(bundle, batches=4, key=row_key) for _ in range(3)]
    assert all(set(epoch) == set(epochs[0]) for epoch in epochs)
    assert epochs[0] != epochs[1]


def test_eval_batches_caps_eval_and_eval_is_repeatable():
    cfg = DataConfig(name="synthetic_image", kind="image", num_samples=8, num_eval_samples=40, eval_batches=2)
    bundle = build(cfg, eval_batch_size=5)
    first = eval_items(bundle, key=image_key)
    assert len(first) == 10 and first == eval_items(bundle, key=image_key)
    assert data_vocab_size(cfg) is None and bundle.num_classes == 10


def test_augmentation_is_seeded_by_seed_and_rank():
    cfg = DataConfig(name="synthetic_image", kind="image", num_samples=16, augment=True)

    def first(rank: int, seed: int) -> torch.Tensor:
        return next(build_data(cfg, rank=rank, world_size=2, batch_size=4, eval_batch_size=4, seed=seed).train)[
            "inputs"
        ]

    assert torch.equal(first(0, 0), first(0, 0))
    assert not torch.equal(first(0, 0), first(0, 1))


def test_random_crop_flip_matches_per_sample_crop():
    images = torch.randint(0, 256, (6, 3, 8, 8), dtype=torch.uint8)
    out = random_crop_flip(images, padding=2, generator=torch.Generator().manual_seed(3))
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    for image, crop in zip(padded, out, strict=True):
        windows = [image[:, y : y + 8, x : x + 8] for y in range(5) for x in range(5)]
        assert any(torch.equal(crop, w) or torch.equal(crop, w.flip(-1)) for w in windows)


# ---------------------------------------------------------------- fineweb-like streams

DOCS = 72  # 8 eval + 64 train; each doc is exactly one 16-token row


def doc_text(i: int) -> str:
    return f"doc{i} " + " ".join(["w"] * 14)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A word-level tokenizer.json trained on the documents: each doc is 15 tokens + </s>."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator([doc_text(i) for i in range(DOCS)], trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory) -> Path:
    """Two parquet files (two shards) with a FineWeb-like text column."""
    root = tmp_path_factory.mktemp("parquet")
    for part in range(2):
        ids = range(part * DOCS // 2, (part + 1) * DOCS // 2)
        table = pa.table({"text": [doc_text(i) for i in ids], "id": [f"<urn:{i}>" for i in ids]})
        pq.write_table(table, root / f"part-{part}.parquet")
    return root


@pytest.fixture(scope="module")
def jsonl_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("jsonl")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": doc_text(i)}) + "\n" for i in range(DOCS)))
    return root


def stream_cfg(path: Path, tokenizer: Path, **changes) -> DataConfig:
    fields = {"path": str(path), "tokenizer": str(tokenizer), "seq_len": 15, "vocab_size": 0, "eval_docs": 8}
    return DataConfig(name="fineweb", kind="text", shuffle_buffer=16, **{**fields, **changes})


def doc_namer(tokenizer_file: Path):
    """Key function naming the document of a row by its first token ("doc17")."""
    names = {i: token for token, i in Tokenizer.from_file(str(tokenizer_file)).get_vocab().items()}

    def doc_name(inputs: torch.Tensor, targets: torch.Tensor) -> str:
        return names[int(inputs[0])]

    return doc_name


def test_jsonl_stream_partitions_docs_across_ranks(jsonl_dir, tokenizer_file):
    cfg = stream_cfg(jsonl_dir, tokenizer_file)
    validate_data(cfg, offline=True)
    prepare_data(cfg)
    batch = next(build(cfg).train)
    assert batch["inputs"].shape == (4, 15) and batch["inputs"].dtype == torch.int64
    assert (batch["targets"][:, -1] == Tokenizer.from_file(str(tokenizer_file)).token_to_id("</s>")).all()
    key = doc_namer(tokenizer_file)
    bundles = [build(cfg, rank=r, world_size=2) for r in range(2)]
    train = [train_items(b, batches=8, key=key) for b in bundles]  # 32 docs per rank = one epoch
    assert_partition(train, total=64)
    evals = [eval_items(b, key=key) for b in bundles]
    assert_partition(evals, total=8)
    assert set().union(*evals) == {f"doc{i}" for i in range(8)}
    assert not set().union(*evals) & set().union(*train)


def test_parquet_shards_split_by_node_without_overlap(parquet_dir, tokenizer_file, monkeypatch):
    import datasets

    # datasets sleeps 5 s whenever a shuffled parquet stream is closed (an arrow
    # thread-shutdown workaround); this test closes two.
    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)
    cfg = stream_cfg(parquet_dir, tokenizer_file)
    key = doc_namer(tokenizer_file)
    bundles = [build(cfg, rank=r, world_size=2) for r in range(2)]
    # One rank's shard holds the 8 eval docs, so 28 train docs, the other 36: 7 batches fit in epoch 0.
    train = [train_items(b, batches=7, key=key) for b in bundles]
    for bundle in bundles:
        bundle.train.close()
    assert_partition(train, total=56)
    assert not set().union(*train) & {f"doc{i}" for i in range(8)}


def test_vocab_cap_maps_cut_ids_to_unk(jsonl_dir, tokenizer_file):
    cfg = stream_cfg(jsonl_dir, tokenizer_file, vocab_size=20)
    validate_data(cfg, offline=True)
    assert data_vocab_size(cfg) == 20
    bundle = build(cfg)
    tokens = torch.cat([b["inputs"] for b in islice(bundle.train, 16)])
    assert int(tokens.max()) < 20 and (tokens == 0).any()  # 0 is <unk>
    assert (
        data_vocab_size(stream_cfg(jsonl_dir, tokenizer_file))
        == Tokenizer.from_file(str(tokenizer_file)).get_vocab_size()
    )


def test_literal_special_token_in_text_is_not_an_eos():
    tok = train_bpe(iter(["some text for a tiny tokenizer"] * 4), vocab_size=300)
    ids = encode_docs(tok, ["before <|endoftext|> after"], limit=300)
    assert ids.tolist().count(tok.eos_id) == 1 and ids[-1] == tok.eos_id


def test_fineweb_hub_path_while_offline(tokenizer_file):
    cfg = stream_cfg("HuggingFaceFW/fineweb", tokenizer_file)
    validate_data(cfg, offline=False)  # no network access needed to validate
    expect_config_error(cfg, "dataset.path", text="unset HF_HUB_OFFLINE")


def test_hub_tokenizer_missing_from_cache_while_offline(jsonl_dir):
    cfg = stream_cfg(jsonl_dir, "sdp-tests/no-such-tokenizer")
    expect_config_error(cfg, "dataset.tokenizer", text="unset HF_HUB_OFFLINE")


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"path": "/nope/fineweb"}, "dataset.path"),
        ({"tokenizer": "/nope/tokenizer.json"}, "dataset.tokenizer"),
        ({"tokenizer": None}, "dataset.tokenizer"),
        ({"eos_token": "<|im_end|>"}, "dataset.eos_token"),
        ({"eval_docs": 0}, "dataset.eval_docs"),
    ],
)
def test_fineweb_bad_values(jsonl_dir, tokenizer_file, changes, key):
    expect_config_error(replace(stream_cfg(jsonl_dir, tokenizer_file), **changes), key)


def test_fineweb_missing_text_column(parquet_dir, tokenizer_file):
    with pytest.raises(ConfigError, match=r"^dataset\.text_column='content'"):
        build(replace(stream_cfg(parquet_dir, tokenizer_file), text_column="content"))


def test_fineweb_dir_without_data_files(tmp_path, tokenizer_file):
    expect_config_error(stream_cfg(tmp_path, tokenizer_file), "dataset.path", text="no *.parquet")


# ---------------------------------------------------------------- local_text


@pytest.fixture()
def text_dir(tmp_path) -> Path:
    root = tmp_path / "corpus"
    for i in range(12):
        sub = root / ("pkg" if i % 3 else "")
        sub.mkdir(parents=True, exist_ok=True)
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(40))
        (sub / f"m{i:02d}.py").write_text(body)
    (root / "site-packages").mkdir()
    (root / "site-packages" / "skipped.py").write_text("x = 1\n")
    (root / "notes.txt").write_text("not python\n")
    return root


def local_cfg(root: Path, tmp_path: Path, **changes) -> DataConfig:
    fields = {
        "path": str(root),
        "cache_dir": str(tmp_path / "cache"),
        "vocab_size": 300,
        "seq_len": 16,
        "eval_every": 4,
    }
    return DataConfig(name="local_text", kind="text", **{**fields, **changes})


def test_local_text_trains_caches_and_reuses(text_dir, tmp_path, monkeypatch):
    cfg = local_cfg(text_dir, tmp_path)
    validate_data(cfg, offline=True)
    files = local_text.list_files(cfg)
    assert len(files) == 12 and not any("site-packages" in name for name, _ in files)
    with pytest.raises(RuntimeError, match="call prepare_data"):
        build(cfg)
    prepare_data(cfg)
    cache = local_text.cache_dir_for(cfg, files)
    stamps = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert set(stamps) == {"tokenizer.json", "train.npy", "eval.npy"}
    monkeypatch.setattr(local_text, "train_bpe", lambda *a, **k: pytest.fail("retrained the tokenizer"))
    prepare_data(cfg)
    assert stamps == {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert np.load(cache / "train.npy").dtype == np.uint16
    batch = next(build(cfg).train)
    assert batch["inputs"].shape == (4, 16) and int(batch["inputs"].max()) < 300
    bundles = [build(cfg, rank=r, world_size=2) for r in range(2)]
    rows = len(np.load(cache / "train.npy")) // 17
    train = [train_items(b, batches=rows // 2 // 4, key=row_key) for b in bundles]
    assert not set(train[0]) & set(train[1])
    assert_partition(
        [eval_items(b, key=row_key) for b in bundles], total=len(np.load(cache / "eval.npy")) // 17 // 2 * 2
    )


@pytest.mark.parametrize("name", ["train.npy", "tokenizer.json"])
def test_a_damaged_local_text_cache_file_is_named_with_how_to_rebuild_it(name, text_dir, tmp_path):
    cfg = local_cfg(text_dir, tmp_path)
    prepare_data(cfg)
    cache = local_text.cache_dir_for(cfg, local_text.list_files(cfg))
    (cache / name).write_bytes((cache / name).read_bytes()[:100])
    if name == "tokenizer.json":
        (cache / "eval.npy").unlink()  # the tokenizer is read again to rebuild what is missing
    with pytest.raises(DamagedFile) as caught:
        prepare_data(cfg)
        build(cfg)
    problem = str(caught.value)
    assert problem.startswith(f"{cache / name}: is truncated or corrupt (")
    assert problem.endswith(f"); delete {cache} and run again: it is rebuilt from dataset.path")


def test_local_text_cache_key_follows_files_and_settings(text_dir, tmp_path):
    cfg = local_cfg(text_dir, tmp_path)
    key = local_text.cache_dir_for(cfg, local_text.list_files(cfg))
    assert key != local_text.cache_dir_for(local_cfg(text_dir, tmp_path, vocab_size=400), local_text.list_files(cfg))
    (text_dir / "m00.py").write_text("changed = True\n")
    assert key != local_text.cache_dir_for(cfg, local_text.list_files(cfg))


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"path": "/nope"}, "dataset.path"),
        ({"text_glob": "**/*.rs"}, "dataset.text_glob"),
        ({"vocab_size": 100}, "dataset.vocab_size"),
        ({"eval_every": 1}, "dataset.eval_every"),
    ],
)
def test_local_text_bad_values(text_dir, tmp_path, changes, key):
    expect_config_error(local_cfg(text_dir, tmp_path, **changes), key)


def test_local_text_on_the_stdlib(tmp_path):
    cfg = DataConfig(name="local_text", kind="text", cache_dir=str(tmp_path), max_files=150, vocab_size=1024)
    validate_data(cfg, offline=True)
    prepare_data(cfg)
    batch = next(build(cfg, batch_size=8).train)
    assert batch["inputs"].shape == (8, 256) and int(batch["inputs"].max()) < 1024


# ---------------------------------------------------------------- CIFAR


def write_cifar(root: Path, *, hundred: bool, per_file: int = 8) -> None:
    """Pickled batches laid out exactly as the official python archives."""
    rng = np.random.default_rng(1)
    label_key = "fine_labels" if hundred else "labels"
    classes = 100 if hundred else 10

    def batch(count: int) -> dict:
        return {
            "data": rng.integers(0, 256, (count, 3072), dtype=np.uint8),
            label_key: list(rng.integers(0, classes, count)),
        }

    folder = root / ("cifar-100-python" if hundred else "cifar-10-batches-py")
    folder.mkdir(parents=True)
    files = (
        {"train": batch(5 * per_file), "test": batch(10)}
        if hundred
        else {
            **{f"data_batch_{i}": batch(per_file) for i in range(1, 6)},
            "test_batch": batch(10),
        }
    )
    files["meta" if hundred else "batches.meta"] = {
        ("fine_label_names" if hundred else "label_names"): [f"c{i}" for i in range(classes)]
    }
    for name, content in files.items():
        with open(folder / name, "wb") as f:
            pickle.dump(content, f)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_loads_pickle_batches(tmp_path, name):
    hundred = name == "cifar100"
    write_cifar(tmp_path, hundred=hundred)
    cfg = DataConfig(name=name, kind="image", path=str(tmp_path), num_classes=100 if hundred else 10, augment=False)
    validate_data(cfg, offline=True)
    prepare_data(cfg)
    batch = next(build(cfg).train)
    assert batch["inputs"].shape == (4, 3, 32, 32) and batch["inputs"].dtype == torch.float32
    assert batch["targets"].dtype == torch.int64 and int(batch["targets"].max()) < cfg.num_classes
    assert batch["inputs"].abs().max() < 3
    bundles = [build(cfg, rank=r, world_size=2) for r in range(2)]
    assert_partition([train_items(b, batches=5, key=image_key) for b in bundles], total=40)
    assert_partition([eval_items(b, key=image_key) for b in bundles], total=10)
    augmented = next(build(replace(cfg, augment=True)).train)["inputs"]
    assert augmented.shape == (4, 3, 32, 32)


def test_a_corrupt_cifar_batch_file_is_named_with_how_to_get_it_back(tmp_path):
    write_cifar(tmp_path, hundred=False)
    damaged = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    damaged.write_bytes(damaged.read_bytes()[:500])
    cfg = DataConfig(name="cifar10", kind="image", path=str(tmp_path), num_classes=10)
    with pytest.raises(DamagedFile) as caught:
        build(cfg)
    assert str(caught.value) == (
        f"{damaged}: is truncated or corrupt (UnpicklingError: pickle data was truncated); delete "
        f"{damaged.parent} and run with dataset.download=true, or restore it from the archive"
    )


def test_cifar_missing_files(tmp_path):
    cfg = DataConfig(name="cifar10", kind="image", path=str(tmp_path))
    expect_config_error(cfg, "dataset.path", text="dataset.download=true")
    validate_data(DataConfig(name="cifar10", kind="image", path=str(tmp_path), download=True), offline=True)


def test_cifar_wrong_num_classes(tmp_path):
    expect_config_error(DataConfig(name="cifar100", kind="image", path=str(tmp_path)), "dataset.num_classes")


# ---------------------------------------------------------------- ImageFolder


@pytest.fixture()
def image_tree(tmp_path) -> Path:
    rng = np.random.default_rng(2)
    for split, count in (("train", 6), ("val", 3)):
        for label in ("cat", "dog"):
            folder = tmp_path / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (30 + i, 40, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return tmp_path


def test_imagenet_folder(image_tree):
    cfg = DataConfig(name="imagenet", kind="image", path=str(image_tree), image_size=16, num_classes=2, augment=False)
    validate_data(cfg, offline=True)
    batch = next(build(cfg, batch_size=3).train)
    assert batch["inputs"].shape == (3, 3, 16, 16) and batch["inputs"].dtype == torch.float32
    assert set(batch["targets"].tolist()) <= {0, 1}
    bundles = [build(cfg, rank=r, world_size=2, batch_size=3) for r in range(2)]
    assert_partition([train_items(b, batches=2, key=image_key) for b in bundles], total=12)
    assert_partition([eval_items(b, key=image_key) for b in bundles], total=6)
    augmenting = replace(cfg, augment=True)
    assert torch.equal(next(build(augmenting).train)["inputs"], next(build(augmenting).train)["inputs"])


def test_imagenet_errors(image_tree):
    cfg = DataConfig(name="imagenet", kind="image", path=str(image_tree / "val"), num_classes=2)
    expect_config_error(cfg, "dataset.path", text="train")
    with pytest.raises(ConfigError, match=r"^dataset\.num_classes=1000"):
        build(DataConfig(name="imagenet", kind="image", path=str(image_tree), num_classes=1000))


# ---------------------------------------------------------------- Fashion-MNIST


@pytest.mark.skipif(not FASHION_MNIST.is_dir(), reason=f"{FASHION_MNIST} absent: apt-get install dataset-fashion-mnist")
def test_fashion_mnist_real_data():
    cfg = DataConfig(name="fashion_mnist", kind="image", path=str(FASHION_MNIST))
    validate_data(cfg, offline=True)
    bundle = build(cfg, batch_size=64, eval_batch_size=1000)
    batch = next(bundle.train)
    assert batch["inputs"].shape == (64, 3, 32, 32) and batch["inputs"].dtype == torch.float32
    assert torch.equal(batch["inputs"][:, 0], batch["inputs"][:, 2])
    labels = torch.cat([b["targets"] for b in bundle.make_eval()])
    assert len(labels) == 10000 and set(labels.tolist()) == set(range(10))
    assert abs(float(next(iter(bundle.make_eval()))["inputs"].mean())) < 0.3


def test_fashion_mnist_missing_files(tmp_path):
    cfg = DataConfig(name="fashion_mnist", kind="image", path=str(tmp_path))
    expect_config_error(cfg, "dataset.path", text="apt-get install dataset-fashion-mnist")


def test_idx_magic_is_checked(tmp_path):
    from sdp.data.fashion_mnist import IMAGES_MAGIC, LABELS_MAGIC, read_idx

    path = tmp_path / "labels.gz"
    with gzip.open(path, "wb") as f:
        f.write(LABELS_MAGIC.to_bytes(4, "big") + (3).to_bytes(4, "big") + bytes([1, 2, 3]))
    assert read_idx(path, magic=LABELS_MAGIC).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="magic"):
        read_idx(path, magic=IMAGES_MAGIC)


def test_a_resumed_parquet_stream_continues_where_the_first_left_off(parquet_dir, tokenizer_file, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)
    cfg = stream_cfg(parquet_dir, tokenizer_file)
    first = build(cfg, rank=1, world_size=2)
    reference = [next(first.train) for _ in range(10)]
    first.train.close()
    resumed = build_data(cfg, rank=1, world_size=2, batch_size=4, eval_batch_size=3, seed=0, start_batch=4).train
    for want in reference[4:]:
        got = next(resumed)
        assert all(torch.equal(got[k], want[k]) for k in want)
    resumed.close()
