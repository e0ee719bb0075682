"""From the run's data options to its batches: the records read once (``--data``, held-out records
from ``--eval-data`` or a seeded ``--eval-split``), one tokenizer and chat template, then random
windows of a text corpus or examples rendered and packed (or padded) into sequences.

Takes the run's data and batch settings as they are (:class:`mobius.config.DataConfig`,
:class:`~mobius.config.BatchConfig`), the seed, the model's name and vocabulary size: the data
package knows nothing else of a run.
"""

from __future__ import annotations

import math

import numpy as np

from mobius.boundary.errors import InputError
from mobius.data.corpus import BatchSource, corpus_of, load_corpus
from mobius.data.examples import renderer_for
from mobius.data.packing import EvalBatches, ExampleBatches, pack
from mobius.data.preference import PairRenderer, PreferenceBatches, PreferenceEvalBatches, pack_pairs
from mobius.data.records import Pair, Record, read_examples
from mobius.data.tokenizers import tokenizer_for
from mobius.models.preference import PreferenceObjective


def build_batches(data, batch, seed: int, model: str, vocab_size: int, objective: PreferenceObjective | None = None
                  ) -> tuple[BatchSource | ExampleBatches, EvalBatches | None]:
    """The run's training batches (random windows of a text corpus, packed or padded examples, or
    preference pairs where ``objective`` is one) and its held-out examples (``--eval-data`` or
    ``--eval-split``, else None)."""
    tokenizer = tokenizer_for(model)

    def checked(largest: int) -> None:
        if largest >= vocab_size:
            raise InputError(f"model {model} has a vocabulary of {vocab_size}, but the data has token id {largest} "
                             f"({tokenizer.name})")

    def windows(corpus) -> BatchSource:
        checked(int(corpus.max()))
        return BatchSource(corpus, batch.seq_len, batch.micro_batch_size, batch.micro_batches, seed, tokenizer.name)

    def packed(records: list[Record], fmt: str, renderer, skipped: list[str], source: str):
        """Examples rendered with the model's template and packed (or padded) into sequences
        (``source``: where they come from, in messages)."""
        packing = data.packing != "off"
        examples = rendered_all(records, lambda r: rendered(renderer, r), data.skip_bad_records, skipped, "examples")
        out = pack(examples, batch.seq_len, packing, seed, data.truncate)
        checked(max(int(out.tokens.max()), int(out.targets.max())))  # a target past the inputs: the last EOS
        trained = int((out.targets >= 0).sum())
        if not trained:  # a run that would train nothing, refused before it starts
            cut = (f": {out.lost_answers} of them lost their whole answer to truncation at --seq-len {batch.seq_len} "
                   "(raise --seq-len)" if out.lost_answers else "")
            raise InputError(f"{source}: none of its {out.examples:,} examples has a token to train on{cut}")
        describe = (f"{out.examples:,} {fmt} examples ({trained:,} trained tokens) "
                    f"{'packed into' if packing else 'padded to'} {out.tokens.shape[0]:,} sequences"
                    + (f", {out.truncated} truncated to --seq-len" if out.truncated else "")
                    + (f" ({out.lost_answers} of them losing their whole answer)" if out.lost_answers else "")
                    + f"; tokenizer {tokenizer.name}, chat template {renderer.template_source}"
                    + (f"; {len(skipped)} bad records skipped (the first: {skipped[0]})" if skipped else ""))
        return out, describe

    if data.path is None:
        return windows(load_corpus(None, tokenizer=tokenizer)), None
    skipped: list[str] = []
    records, held_out, fmt = _records(data, seed, skipped if data.skip_bad_records else None)
    if (fmt == "preference") != (objective is not None):
        raise InputError(f"--data {data.path} holds preference pairs (chosen/rejected): train them with --objective "
                         "dpo" if objective is None else
                         f"--objective dpo trains on preference pairs ([prompt/]chosen/rejected); --data {data.path} "
                         f"holds {fmt} records")
    if objective is not None:
        renderer = renderer_for(model, data.chat_template, False)
        train = preference_batches(records, data, batch, seed, objective, renderer, skipped, checked)
        held = preference_batches(held_out, data, batch, seed, objective, renderer, [], checked, evaluation=True) \
            if held_out else None
        return train, held
    renderer = None
    if fmt == "text" and data.packing == "auto":  # a corpus: random windows, as in pre-training
        train = windows(corpus_of([r.prompt for r in records], tokenizer, data.path))
    else:
        renderer = renderer_for(model, data.chat_template, data.train_on_prompt)
        sequences, describe = packed(records, fmt, renderer, skipped, f"--data {data.path}")
        train = ExampleBatches(sequences, batch.micro_batch_size, batch.micro_batches, seed, data.packing != "off",
                               describe)
    if not (data.eval_path or data.eval_split):
        return train, None
    renderer = renderer or renderer_for(model, data.chat_template, data.train_on_prompt)
    sequences, describe = packed(held_out, fmt, renderer, [], f"--eval-data {data.eval_path}" if data.eval_path
                                 else f"--eval-split {data.eval_split} of --data {data.path}")
    return train, EvalBatches(sequences, batch.micro_batch_size, batch.micro_batches, data.packing != "off", describe)


def preference_batches(records: list[Pair], data, batch, seed: int, objective: PreferenceObjective, renderer,
                       skipped: list[str], checked, evaluation: bool = False) -> PreferenceBatches:
    """Preference pairs rendered as TRL renders them and packed (or padded) two sides to a row
    (:mod:`mobius.data.preference`); a bad pair refused, or with ``--skip-bad-records`` left out."""
    pairs_renderer = PairRenderer(renderer)
    pairs = rendered_all(records, pairs_renderer.render, data.skip_bad_records, skipped, "pairs")
    packing = data.packing == "on"
    out = pack_pairs(pairs, batch.seq_len, packing, seed, data.truncate)
    checked(max(int(out.tokens.max()), int(out.targets.max())))
    describe = (f"{out.examples:,} preference pairs ({int((out.targets >= 0).sum()):,} trained tokens) "
                f"{'packed into' if packing else 'padded to'} {out.tokens.shape[0]:,} sequences"
                + (f", {out.truncated} cut to --seq-len / 2 a side" if out.truncated else "")
                + (f", {out.lost_answers} left out (truncation cut an answer away)" if out.lost_answers else "")
                + f"; chat template {pairs_renderer.template_source}; {objective.describe()}, against the "
                f"reference log-probabilities of one forward-only pass over these {out.tokens.shape[0]:,} sequences "
                "before training"
                + (f"; {len(skipped)} bad records skipped (the first: {skipped[0]})" if skipped else ""))
    if evaluation:
        return PreferenceEvalBatches(out, batch.micro_batch_size, batch.micro_batches, objective, describe)
    return PreferenceBatches(out, batch.micro_batch_size, batch.micro_batches, seed, objective, describe)


def rendered_all(records: list, render, skip_bad: bool, skipped: list[str], what: str) -> list:
    """``render`` of each record; a bad one refused, or with ``--skip-bad-records`` (``skip_bad``)
    left out into ``skipped``; refused when none is left."""
    out = []
    for r in records:
        try:
            out.append(render(r))
        except InputError as err:
            if not skip_bad:
                raise
            skipped.append(str(err))
    if not out:
        raise InputError(f"every one of the {len(skipped)} {what} is bad (the first: {skipped[0]})")
    return out


def rendered(renderer, record: Record):
    """``record`` as an example, refused naming where it came from when the template refuses it or
    it leaves nothing to train on (an empty answer would teach the end of text right after the
    prompt)."""
    try:
        example = renderer.render(record)
    except InputError as err:
        raise InputError(f"{record.where}: {err}" if record.where and not str(err).startswith(record.where)
                         else str(err)) from None
    trained = example.trained[:-1] if getattr(renderer, "eos_id", None) is not None else example.trained
    if not trained.any():
        raise InputError(f"{record.where or 'a record'}: nothing to train on (an empty answer): the example would "
                         "teach only the end of text")
    return example


def _records(data, seed: int, skipped: list[str] | None) -> tuple[list[Record], list[Record], str]:
    """The training and held-out records (``--eval-data``, or ``--eval-split`` of ``--data`` by a
    seeded draw) and their format; bad ones left out into ``skipped`` where it is given."""
    records, fmt = read_examples(data.path, data.format, skipped=skipped)
    if data.eval_path:
        held_out, eval_fmt = read_examples(data.eval_path, data.format, option="--eval-data", skipped=skipped)
        if eval_fmt != fmt:
            raise InputError(f"--eval-data {data.eval_path} holds {eval_fmt} records, --data {data.path} {fmt} records")
        return records, held_out, fmt
    if not data.eval_split:
        return records, [], fmt
    n_eval = math.ceil(data.eval_split * len(records))
    if n_eval >= len(records):
        raise InputError(f"--eval-split {data.eval_split} of {len(records)} records leaves none to train on")
    order = np.random.default_rng([seed, 0xe7a1]).permutation(len(records))
    held = set(order[:n_eval].tolist())
    return ([r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)], fmt)
