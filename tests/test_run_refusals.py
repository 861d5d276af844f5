"""Bad input that shows once a run has started (its data, its disk) or when a reader meets a
damaged file, through the entrypoints: one `error:` line naming the key or the path, no
traceback, and nothing written before lost. Each of these printed a traceback before."""

import gzip
import json
import shutil
from pathlib import Path

import pytest
from conftest import launch
from test_collect import _run
from test_faults import small_disk

from sdp import collect, train

TEXT = ["model=llama_tiny", "logger=none", "trainer.max_steps=2", "trainer.eval_every=0", "trainer.export=none"]
FMNIST = Path("/usr/share/datasets/fashion-mnist")


def _error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    return line


def test_a_corpus_too_small_for_the_seq_len_and_batch_says_which_to_lower(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):  # every other file is eval (dataset.eval_every=2): 2 train files
        (corpus / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 40)
    text = ["dataset=local_text", f"dataset.path={corpus}", "dataset.eval_every=2", "dataset.vocab_size=300"]
    text += [f"dataset.cache_dir={tmp_path / 'cache'}", "trainer.global_batch_size=4", "dataset.seq_len=256"]
    proc = launch([*TEXT, *text, f"run_dir={tmp_path / 'run'}"], nproc=1, cwd=tmp_path)
    tokens = int(_error_line(proc.stderr).split(" has ")[1].split()[0])
    rows, longest = tokens // 257, tokens // 4 - 1
    assert proc.returncode == 2 and 0 < rows < 4 and longest < 256
    assert _error_line(proc.stderr) == (
        f"error: dataset.seq_len=256: the train split of dataset.name='local_text' has {tokens} tokens: {rows} rows "
        f"of seq_len + 1 per rank for 1 rank(s), and a rank's batch takes 4; lower dataset.seq_len to at most "
        f"{longest} or trainer.global_batch_size to at most {rows} per rank, or use more data"
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("ConfigError: dataset.seq_len=256: ")


@pytest.mark.skipif(not FMNIST.is_dir(), reason="Debian's dataset-fashion-mnist (make setup installs it)")
def test_a_truncated_fashion_mnist_file_is_named_with_how_to_get_it_back(tmp_path):
    data = tmp_path / "fmnist"
    data.mkdir()
    for path in FMNIST.glob("*-ubyte.gz"):
        shutil.copy(path, data / path.name)
    damaged = data / "train-images-idx3-ubyte.gz"
    damaged.write_bytes(damaged.read_bytes()[:100_000])
    image = ["model=resnet_tiny", "dataset=fashion_mnist", f"dataset.path={data}", "trainer.global_batch_size=8"]
    proc = launch([*TEXT[1:], *image, f"run_dir={tmp_path / 'run'}"], nproc=1, cwd=tmp_path)
    assert proc.returncode == 2
    assert _error_line(proc.stderr) == (
        f"error: {damaged}: is truncated or corrupt (EOFError: Compressed file ended before the end-of-stream "
        f"marker was reached); replace it with the original, or point dataset.path at Debian's copy in {FMNIST}"
    )


def test_a_resume_on_a_full_disk_is_one_line_and_loses_nothing(tmp_path):
    run = [*TEXT, "dataset=synthetic_text", "dataset.seq_len=32", "trainer.global_batch_size=8"]
    run += ["trainer.max_steps=4", "trainer.checkpoint_every=2"]
    with small_disk(tmp_path / "disk", 64) as disk:  # a checkpoint of the tiny LLaMA is 21 MB
        run_dir = disk / "run"
        first = launch([*run, "trainer.stop_at_step=2", f"run_dir={run_dir}"], nproc=1, cwd=tmp_path)
        assert first.returncode == 0, first.stderr[-3000:]
        before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
        free = shutil.disk_usage(disk).free
        (disk / "filler").write_bytes(b"\0" * free)  # the disk is full
        proc = launch([*run, f"run_dir={run_dir}"], nproc=1, cwd=tmp_path)
        assert proc.returncode == 3
        assert _error_line(proc.stderr) == (
            f"error: {run_dir}: no space left on device, 0.0 MiB free; free space, then the same command "
            "resumes from step 2"
        )
        assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before  # no .tmp either


@pytest.mark.parametrize(
    "key,value,says",
    [
        ("eval_acc", "NaN", "eval_acc='NaN': must be a number or null"),
        ("coverage", "0.5", "coverage='0.5': must be a number"),
        ("world_size", "4", "world_size='4': must be an integer"),
        ("memory", {"peak_bytes": "NaN"}, "memory.peak_bytes='NaN': must be a number or null"),
    ],
)
def test_collect_names_the_file_and_the_key_of_a_number_written_as_a_string(key, value, says, tmp_path, capsys):
    run_dir = _run(tmp_path / "runs", "ddp")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary[key] = value
    (run_dir / "summary.json").write_text(json.dumps(summary))
    assert collect.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--no-plots"]) == 2
    assert capsys.readouterr().err == f"error: {run_dir / 'summary.json'}: is not a run's summary: {says}\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "override,says",
    [
        ("parallelism.backend=nccl", "parallelism.backend='nccl': needs CUDA, which this machine lacks"),
        ("parallelism.timeout_s=1e10", "parallelism.timeout_s=10000000000.0: must be in [10, 2147483] seconds"),
        ("parallelism.timeout_s=0.001", "parallelism.timeout_s=0.001: must be in [10, 2147483] seconds"),
        (
            "parallelism.bucket_cap_mb=1e20",
            "parallelism.bucket_cap_mb=1e+20: must be at most 8.796e+12 MiB: its bytes must fit a 64-bit integer",
        ),
        (
            "parallelism.comm_group_overhead_mb=9e12",
            "parallelism.comm_group_overhead_mb=9000000000000.0: must be at most 8.796e+12 MiB: its bytes must fit a "
            "64-bit integer",
        ),
    ],
)
def test_the_launcher_refuses_what_its_process_group_cannot_do(override, says, tmp_path, capsys, monkeypatch):
    import torch

    if "nccl" in override and torch.cuda.is_available():
        pytest.skip("a refusal of a machine without CUDA")
    monkeypatch.chdir(tmp_path)
    argv = ["--nproc-per-node=2", "model=resnet_tiny", "dataset=synthetic_image", override]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {says}") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_an_inner_width_whose_heads_do_not_divide_the_hidden_size_names_the_widths_that_work(tmp_path, capsys):
    # llama_tiny: 2 KV groups of 2 heads, hidden size 128. x 1.5 gives 6 heads, which transformers
    # refuses (it used to surface as its own message about heads); 0.5, 1, 2, 4 and 8 work.
    argv = ["--nproc-per-node=1", "model=llama_tiny", "dataset=synthetic_text", "model.inner_width=1.5"]
    assert train.main([*argv, f"output_root={tmp_path}"]) == 2
    assert capsys.readouterr().err == (
        "error: model.inner_width=1.5: gives 6 attention heads (3 KV groups x 2), which must divide "
        "model.hidden_size=128 (transformers' LlamaConfig requires it); the widths that work up to 8: "
        "0.5, 1, 2, 4, 8\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_idx_file_is_named_whatever_the_damage(tmp_path):
    from sdp.data.fashion_mnist import LABELS_MAGIC, read_idx
    from sdp.paths import DamagedFile

    path = tmp_path / "labels.gz"
    with gzip.open(path, "wb") as f:
        f.write(LABELS_MAGIC.to_bytes(4, "big") + (30).to_bytes(4, "big") + bytes(range(30)))
    path.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(DamagedFile, match=rf"^{path}: is truncated or corrupt \(EOFError: .*\); replace it"):
        read_idx(path, magic=LABELS_MAGIC)


def test_a_sweep_dir_that_cannot_be_made_is_named_as_itself(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["-m", "model=resnet_tiny", "dataset=synthetic_image", "seed=0,1", "sweep.dir=/proc/sdp-sweep"]
    assert train.main([*argv, "sweep.dry_run=true"]) == 2
    assert capsys.readouterr().err == (
        "error: sweep.dir='/proc/sdp-sweep': cannot be created or written in: No such file or directory (in /proc)\n"
    )  # it named the first job's run_dir, /proc/sdp-sweep/000-seed_0
