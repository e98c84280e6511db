"""Specification of automicro.data: synthetic and byte-level text datasets, and the dataloader."""

from __future__ import annotations

import os
import sysconfig

import pytest
import torch
import torch.distributed
from torch.utils.data import DistributedSampler

from automicro.data import ByteTextCorpus, DataError, SyntheticTokens, build_dataloader, default_text_paths
from automicro.data.datasets import DOCUMENT_SEPARATOR

# --- SyntheticTokens --------------------------------------------------------------------------


def test_synthetic_sample_is_input_ids_and_next_token_labels_of_seq_len():
    data = SyntheticTokens(num_samples=10, seq_len=16, vocab_size=100, seed=0)
    assert len(data) == 10
    sample = data[3]
    assert set(sample) == {"input_ids", "labels"}
    assert sample["input_ids"].shape == sample["labels"].shape == (16,)
    assert sample["input_ids"].dtype == sample["labels"].dtype == torch.long
    torch.testing.assert_close(sample["input_ids"][1:], sample["labels"][:-1])
    assert 0 <= int(sample["input_ids"].min()) and int(sample["input_ids"].max()) < 100


def test_synthetic_samples_are_deterministic_per_seed_and_index_whatever_the_order():
    a = SyntheticTokens(50, 32, 1000, seed=7)
    b = SyntheticTokens(50, 32, 1000, seed=7)
    forward = [a[i]["input_ids"] for i in range(50)]
    backward = [b[i]["input_ids"] for i in reversed(range(50))][::-1]
    for x, y in zip(forward, backward):
        assert torch.equal(x, y)
    assert not torch.equal(a[0]["input_ids"], a[1]["input_ids"])


def test_synthetic_different_seeds_give_different_data():
    a = SyntheticTokens(4, 32, 1000, seed=0)
    b = SyntheticTokens(4, 32, 1000, seed=1)
    assert not any(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in range(4))


def test_synthetic_index_out_of_range_raises_index_error_and_negative_indices_wrap():
    data = SyntheticTokens(3, 8, 10, seed=0)
    with pytest.raises(IndexError):
        data[3]
    assert torch.equal(data[-1]["input_ids"], data[2]["input_ids"])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(num_samples=0), "num_samples"),
        (dict(seq_len=-1), "seq_len"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(seed=-1), "seed"),
    ],
)
def test_synthetic_bad_arguments_raise_data_error_naming_them(kwargs, name):
    args = {**dict(num_samples=4, seq_len=8, vocab_size=10, seed=0), **kwargs}
    with pytest.raises(DataError, match=name):
        SyntheticTokens(**args)


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


# --- ByteTextCorpus ---------------------------------------------------------------------------


def test_byte_corpus_tokens_are_the_exact_bytes_of_the_file(tmp_path):
    payload = bytes(range(1, 256)) + "héllo wörld\n".encode()  # all nonzero byte values, plus UTF-8
    path = tmp_path / "data.txt"
    path.write_bytes(payload)
    corpus = ByteTextCorpus([str(path)], seq_len=len(payload) - 1)
    assert corpus.vocab_size == 256
    assert len(corpus) == 1
    sample = corpus[0]
    assert bytes(sample["input_ids"].tolist()) == payload[:-1]
    assert bytes(sample["labels"].tolist()) == payload[1:]
    assert sample["input_ids"].dtype == torch.long


def test_byte_corpus_samples_are_non_overlapping_windows_of_seq_len_plus_one(tmp_path):
    payload = bytes((i * 7 + 3) % 251 + 1 for i in range(103))
    (tmp_path / "a.txt").write_bytes(payload)
    corpus = ByteTextCorpus([tmp_path / "a.txt"], seq_len=9)
    assert len(corpus) == 103 // 10  # the trailing partial window is dropped
    for i in range(len(corpus)):
        window = payload[i * 10 : (i + 1) * 10]
        assert bytes(corpus[i]["input_ids"].tolist()) == window[:-1]
        assert bytes(corpus[i]["labels"].tolist()) == window[1:]


def test_byte_corpus_joins_files_with_a_separator_byte_in_sorted_order_for_directories(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_bytes(b"BBBB")
    (tmp_path / "a.py").write_bytes(b"AAAA")
    (tmp_path / "sub" / "c.txt").write_bytes(b"CCCC")
    (tmp_path / "ignored.bin").write_bytes(b"XXXX")
    corpus = ByteTextCorpus([tmp_path], seq_len=13)
    assert [os.path.basename(f) for f in corpus.files] == ["a.py", "b.md", "c.txt"]
    sep = bytes([DOCUMENT_SEPARATOR])
    expected = b"AAAA" + sep + b"BBBB" + sep + b"CCCC"
    assert corpus.num_bytes == len(expected)
    assert bytes(corpus[0]["input_ids"].tolist()) + bytes([corpus[0]["labels"][-1].item()]) == expected


def test_byte_corpus_accepts_a_single_path_string(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"x" * 20)
    assert len(ByteTextCorpus(str(tmp_path / "a.txt"), seq_len=4)) == 4


def test_byte_corpus_max_bytes_truncates_the_corpus(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"y" * 1000)
    corpus = ByteTextCorpus([tmp_path / "a.txt"], seq_len=9, max_bytes=55)
    assert corpus.num_bytes == 55 and len(corpus) == 5


def test_byte_corpus_nonexistent_path_raises_naming_the_path_and_data_paths(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError) as info:
        ByteTextCorpus([str(missing)], seq_len=8)
    assert str(missing) in str(info.value) and "data.paths" in str(info.value)


def test_byte_corpus_empty_raises_with_byte_count_and_seq_len(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"0 bytes.*seq_len"):
        ByteTextCorpus([tmp_path / "empty.txt"], seq_len=8)


def test_byte_corpus_directory_without_text_files_raises(tmp_path):
    (tmp_path / "data.bin").write_bytes(b"z" * 100)
    with pytest.raises(DataError, match=r"0 bytes"):
        ByteTextCorpus([tmp_path], seq_len=8)


def test_byte_corpus_shorter_than_one_sample_raises_with_byte_count_and_seq_len(tmp_path):
    (tmp_path / "short.txt").write_bytes(b"abcde")
    with pytest.raises(DataError, match=r"5 bytes.*seq_len \+ 1 = 6"):
        ByteTextCorpus([tmp_path / "short.txt"], seq_len=5)
    assert len(ByteTextCorpus([tmp_path / "short.txt"], seq_len=4)) == 1


def test_byte_corpus_defaults_to_the_standard_library_sources():
    corpus = ByteTextCorpus(None, seq_len=64, max_bytes=200_000)
    assert 0 < corpus.num_bytes <= 200_000
    assert len(corpus) == corpus.num_bytes // 65
    assert all(f.endswith(".py") for f in corpus.files)


# --- default_text_paths -----------------------------------------------------------------------


def test_default_text_paths_are_sorted_stdlib_py_files_without_tests_or_site_packages():
    paths = default_text_paths()
    assert paths
    stdlib = sysconfig.get_paths()["stdlib"]
    assert all(p.startswith(stdlib) and p.endswith(".py") for p in paths)
    for p in paths:
        parts = os.path.relpath(p, stdlib).split(os.sep)[:-1]
        assert not {"site-packages", "dist-packages", "test", "tests"} & set(parts), p


def test_default_text_paths_are_deterministic_and_capped_by_max_bytes():
    assert default_text_paths(max_bytes=300_000) == default_text_paths(max_bytes=300_000)
    capped = default_text_paths(max_bytes=300_000)
    assert sum(os.path.getsize(p) for p in capped) <= 300_000
    assert len(default_text_paths()) > len(capped)
    assert default_text_paths()[: len(capped)] == capped


# --- build_dataloader -------------------------------------------------------------------------


def test_build_dataloader_on_a_single_process_yields_full_batches_of_the_right_shape():
    assert not torch.distributed.is_initialized()
    data = SyntheticTokens(num_samples=37, seq_len=12, vocab_size=50, seed=0)
    loader = build_dataloader(data, batch_size=8)
    assert isinstance(loader.sampler, DistributedSampler)
    assert loader.sampler.num_replicas == 1 and loader.sampler.rank == 0
    batches = list(loader)
    assert len(batches) == len(loader) == 37 // 8
    for batch in batches:
        assert batch["input_ids"].shape == batch["labels"].shape == (8, 12)
        assert batch["input_ids"].dtype == torch.long


def test_build_dataloader_without_shuffle_keeps_dataset_order_and_keeps_the_last_batch_when_asked():
    data = SyntheticTokens(num_samples=10, seq_len=4, vocab_size=50, seed=0)
    loader = build_dataloader(data, batch_size=4, shuffle=False, drop_last=False)
    batches = list(loader)
    assert [len(b["input_ids"]) for b in batches] == [4, 4, 2]
    assert torch.equal(batches[0]["input_ids"][1], data[1]["input_ids"])


def test_build_dataloader_shuffle_is_seeded():
    data = SyntheticTokens(num_samples=32, seq_len=4, vocab_size=1000, seed=0)
    first = lambda seed: next(iter(build_dataloader(data, batch_size=8, seed=seed)))["input_ids"]  # noqa: E731
    assert torch.equal(first(3), first(3))
    assert not torch.equal(first(3), first(4))


def test_build_dataloader_over_byte_corpus(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"hello world " * 100)
    loader = build_dataloader(ByteTextCorpus([tmp_path], seq_len=16), batch_size=4)
    batch = next(iter(loader))
    assert batch["input_ids"].shape == (4, 16)
    assert int(batch["input_ids"].max()) < 256


def test_build_dataloader_with_too_few_samples_for_one_batch_raises():
    with pytest.raises(DataError, match="no batches"):
        build_dataloader(SyntheticTokens(3, 4, 10), batch_size=8)


def test_build_dataloader_rejects_non_positive_batch_size():
    with pytest.raises(DataError, match="batch_size"):
        build_dataloader(SyntheticTokens(3, 4, 10), batch_size=0)


# --- multi-rank sharding ------------------------------------------------------------------------


def _first_epoch_indices(rank, world_size):
    data = SyntheticTokens(num_samples=40, seq_len=4, vocab_size=1_000_000, seed=0)
    loader = build_dataloader(data, batch_size=5, seed=0)
    lookup = {tuple(data[i]["input_ids"].tolist()): i for i in range(len(data))}
    return [lookup[tuple(row.tolist())] for batch in loader for row in batch["input_ids"]]


@pytest.mark.multiproc
def test_build_dataloader_gives_each_rank_a_disjoint_shard():
    from automicro.testing.multiprocess import run_multiprocess

    per_rank = run_multiprocess(_first_epoch_indices, world_size=2, timeout_s=60)
    assert [len(indices) for indices in per_rank] == [20, 20]
    assert set(per_rank[0]).isdisjoint(per_rank[1])
    assert set(per_rank[0]) | set(per_rank[1]) == set(range(40))
