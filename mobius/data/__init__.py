"""Training data: reading records and text (:mod:`.records`), tokenizers (:mod:`.tokenizers`),
rendering examples with the model's chat template (:mod:`.examples`), text windows
(:mod:`.corpus`) and packed example sequences (:mod:`.packing`), built from a run's data options by
:mod:`.build`.  Every source yields the :class:`Batch` es of step ``k`` as a pure function of
``(seed, k)``."""

from mobius.data.corpus import Batch, BatchSource, load_corpus, stdlib_corpus_files
from mobius.data.packing import ExampleBatches, pack
from mobius.data.records import FORMATS, read_examples
from mobius.data.tokenizers import ByteTokenizer, HFTokenizer, tokenizer_for

__all__ = ["Batch", "BatchSource", "ByteTokenizer", "ExampleBatches", "FORMATS", "HFTokenizer", "load_corpus",
           "pack", "read_examples", "stdlib_corpus_files", "tokenizer_for"]
