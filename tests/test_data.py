import os

import numpy as np
import pytest
import torch

from mobius.boundary.errors import InputError
from mobius.data import BatchSource, ByteTokenizer, load_corpus


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


def test_shared_data_is_mapped_once_and_gives_the_same_batches(tmp_path):
    """The launcher's tokenized data, written once and memory-mapped by the workers: the same
    batches for every step (windows, packed examples, held-out passes), from read-only mappings
    in the smallest integer types, never int64 copies of the whole data."""
    from mobius.data.examples import Example
    from mobius.data.packing import EvalBatches, ExampleBatches, pack
    from mobius.data.shared import open_shared, share

    corpus = load_corpus(None, max_bytes=100_000)
    windows = BatchSource(corpus, 32, 2, 3, seed=7)
    rng = np.random.default_rng(0)
    examples = [Example(rng.integers(0, 300, n), rng.random(n) < 0.5) for n in rng.integers(3, 40, 50)]
    packed = pack(examples, 48, packing=True, seed=1)
    assert packed.tokens.dtype == np.uint16 and packed.targets.dtype == np.int16  # IGNORE is -100
    assert packed.positions.dtype == np.uint8 and packed.segments.dtype == np.int8
    examples = (ExampleBatches(packed, 2, 3, 5, True, "ex"), EvalBatches(packed, 2, 3, True, "ev"))
    for train, held in ((windows, None), examples):
        (tmp_path / type(train).__name__).mkdir()
        got_train, got_held = open_shared(share(train, held, tmp_path / type(train).__name__))
        arrays = [got_train.corpus] if held is None else [getattr(got_train.packed, a) for a in packed.ARRAYS]
        assert all(isinstance(a, np.memmap) and not a.flags.writeable for a in arrays)
        assert got_train.host_bytes() == train.host_bytes() and got_train.describe() == train.describe()
        for k in (0, 9):
            for a, b in zip(train.step(k), got_train.step(k)):
                assert a.tokens.dtype == b.tokens.dtype == torch.int64 and torch.equal(a.tokens, b.tokens)
                for f in ("targets", "positions", "segments"):
                    x, y = getattr(a.layout, f), getattr(b.layout, f)
                    assert (x is None and y is None) or torch.equal(x, y), f
                assert a.layout.loss_tokens == b.layout.loss_tokens
        if held is None:
            assert got_held is None
        else:
            assert got_held.passes == held.passes and got_held.trained == held.trained
            assert all(torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)
                       for k in range(held.passes) for a, b in zip(held.pass_batches(k), got_held.pass_batches(k)))


def test_a_long_text_is_tokenized_in_bounded_pieces_into_the_same_tokens(tmp_path, monkeypatch):
    """A subword tokenizer is never handed more than ``ENCODE_CHARS`` characters a piece (a 100 MiB
    single line made it allocate 5 GB and abort), nor more pieces at once than there are cores;
    cut at whitespace, the tokens are those of the whole text."""
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from mobius.data import tokenizers as T

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(tmp_path / "tokenizer.json"))
    hf = T.HFTokenizer(tmp_path / "tokenizer.json")
    text = "the quick brown fox jumps over the lazy dog\n" * 300
    whole = hf.encode(text)
    assert len(whole) < len(text) / 2  # merges happened: a real subword tokenizer

    calls, batches = [], []

    class Spy:
        def encode(self, piece, add_special_tokens):
            calls.append(len(piece))
            return bpe.encode(piece, add_special_tokens=add_special_tokens)

        def encode_batch(self, batch, add_special_tokens):  # a core a piece
            calls.extend(len(piece) for piece in batch)
            batches.append(len(batch))
            return bpe.encode_batch(batch, add_special_tokens=add_special_tokens)

    hf.tokenizer = Spy()
    monkeypatch.setattr(T, "ENCODE_CHARS", 100)
    assert np.array_equal(hf.encode(text), whole)
    assert len(calls) > 100 and max(calls) <= 100
    assert max(batches) == min(os.cpu_count() or 1, len(calls))
    assert "".join(T.pieces("x" * 250, 100)) == "x" * 250 and T.pieces("x" * 250, 100)[0] == "x" * 100  # no space
