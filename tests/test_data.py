import numpy as np
import pytest
import torch

from mobius.data import BatchSource, ByteTokenizer, load_corpus
from mobius.errors import InputError


def test_same_seed_same_batches_and_targets_are_shifted():
    corpus = load_corpus(None, max_bytes=200_000)
    a = BatchSource(corpus, 32, 2, 3, seed=7).step(4)
    b = BatchSource(corpus, 32, 2, 3, seed=7).step(4)
    c = BatchSource(corpus, 32, 2, 3, seed=8).step(4)
    assert len(a) == 3 and a[0].tokens.shape == (2, 32)
    assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, b))
    assert not all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, c))
    assert torch.equal(a[0].tokens[:, 1:], a[0].targets[:, :-1])


def test_text_file_and_directory(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("more text")
    assert load_corpus(tmp_path / "a.txt").size == 120
    assert load_corpus(tmp_path).size == 120 + 2 + 9  # documents joined by a blank line
    assert ByteTokenizer().decode(load_corpus(tmp_path / "a.txt")[:5]) == "hello"


def test_missing_and_empty_data(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_corpus(tmp_path / "nope")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(InputError, match="empty"):
        load_corpus(tmp_path / "empty.txt")
    with pytest.raises(InputError, match="fewer than"):
        BatchSource(np.zeros(10, dtype=np.uint8), 32, 1, 1, 0)
