"""Every data format and file type a run reads, the answer masks the chat template draws, and every
bad shape refused in one line."""

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from mobius.boundary.errors import InputError  # noqa: E402
from mobius.data import read_examples  # noqa: E402
from mobius.models import IGNORE  # noqa: E402
from conftest import SINGLE, one_line_exit_2  # noqa: E402

from mobius.train import main as train_main  # noqa: E402

CHAT = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                     {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
                     {"role": "assistant", "content": "A2"}]}
RECORDS = {
    "text": {"text": "plain words"},
    "alpaca": {"instruction": "Do it", "input": "with this", "output": "done"},
    "chat": CHAT,
    "sharegpt": {"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"}]},
    "completion": {"prompt": "2+2=", "completion": "4"},
}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("fmt", list(RECORDS))
def test_each_shape_detected_from_its_fields(tmp_path, fmt):
    records, found = read_examples(write_jsonl(tmp_path / "d.jsonl", [RECORDS[fmt]] * 2))
    assert found == fmt and len(records) == 2
    r = records[0]
    if fmt == "text":
        assert (r.prompt, r.answer, r.messages) == ("plain words", None, None)
    elif fmt == "completion":
        assert (r.prompt, r.answer) == ("2+2=", "4")
    elif fmt == "alpaca":
        assert r.messages == [{"role": "user", "content": "Do it\n\nwith this"}, {"role": "assistant", "content": "done"}]
    elif fmt == "sharegpt":
        assert r.messages == [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}]
    else:
        assert r.messages == CHAT["messages"]


def test_conversational_prompt_completion_and_forced_format(tmp_path):
    rec = {"prompt": [{"role": "user", "content": "Q"}], "completion": [{"role": "assistant", "content": "A"}]}
    records, fmt = read_examples(write_jsonl(tmp_path / "c.jsonl", [rec]))
    assert fmt == "completion" and [m["role"] for m in records[0].messages] == ["user", "assistant"]
    both = {"text": "t", "messages": CHAT["messages"]}
    assert read_examples(write_jsonl(tmp_path / "b.jsonl", [both]))[1] == "chat"
    assert read_examples(tmp_path / "b.jsonl", "text")[1] == "text"


def test_file_types_json_parquet_text_directory_and_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [RECORDS["alpaca"], {**RECORDS["alpaca"], "output": "again"}]
    (tmp_path / "list.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved_dict"))
    for name in ("list.json", "rows.parquet", "saved", "saved_dict"):
        records, fmt = read_examples(tmp_path / name)
        assert fmt == "alpaca" and [r.messages[1]["content"] for r in records] == ["done", "again"], name
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.txt").write_text("first")
    (docs / "sub" / "b.md").write_text("\ufeffsecond")  # a byte-order mark is not text
    write_jsonl(docs / "c.jsonl", [RECORDS["text"]])
    records, fmt = read_examples(docs)
    assert fmt == "text" and [r.prompt for r in records] == ["first", "plain words", "second"]


def test_answer_masks_follow_the_chat_template(tmp_path):
    """Only the assistant turns (with their end-of-turn marker) and the final EOS are trained;
    --train-on-prompt trains every token."""
    transformers = pytest.importorskip("transformers")
    from make_tiny_chat_model import make_tiny_chat_model

    from mobius.config import RunConfig
    from mobius.runtime.inputs import make_batches, model_config_for

    model = make_tiny_chat_model(tmp_path / "m", hidden=32, layers=2)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    data = write_jsonl(tmp_path / "chat.jsonl", [CHAT])
    for on_prompt in (False, True):
        cfg = RunConfig.of(model=str(model), data=str(data), seq_len=128, micro_batch_size=1, micro_batches=1,
                           train_on_prompt=on_prompt)
        mb = make_batches(cfg, model_config_for(cfg)).step(0)[0]
        targets = mb.targets[0]
        text = tok.decode(targets[targets != IGNORE])
        if on_prompt:
            full = tok.apply_chat_template(CHAT["messages"], tokenize=False)
            assert text == full[len("<|im_start|>"):]  # every next token
        else:
            assert text == "A1<|im_end|>\nA2<|im_end|>\n"  # the turns' ends, and no EOS after them


# Each family's chat template as its models ship it, and TRL's training variant of it (the
# assistant's output inside {% generation %}, as trl/chat_templates/*_training.jinja draw it), which
# is what TRL's assistant_only_loss trains through transformers' return_assistant_tokens_mask.
FAMILIES = {
    "chatml": ("<|im_end|>", [],
               "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
               "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
               "{% generation %}{{ m['content'] + '<|im_end|>\n' }}{% endgeneration %}{% else %}"
               "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "llama3": ("<|eot_id|>", [],
               "{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}{{ '<|start_header_id|>' + "
               "m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
               "{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}{% if m['role'] == 'assistant' %}"
               "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% generation %}"
               "{{ m['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}{{ '<|start_header_id|>' + "
               "m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    "gemma": ("<eos>", ["system"],
              "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{% set role = 'model' %}"
              "{% else %}{% set role = m['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + m['content'] | trim"
              " + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}"
              "{% endif %}",
              "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<start_of_turn>model\n' }}"
              "{% generation %}{{ m['content'] | trim + '<end_of_turn>\n' }}{% endgeneration %}{% else %}"
              "{{ '<start_of_turn>' + m['role'] + '\n' + m['content'] | trim + '<end_of_turn>\n' }}{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"),
    "phi3": ("<|endoftext|>", [],
             "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}",
             "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|assistant|>\n' }}{% generation %}"
             "{{ m['content'] + '<|end|>\n' }}{% endgeneration %}{% else %}{{ '<|' + m['role'] + '|>\n' + "
             "m['content'] + '<|end|>\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
             "{{ '<|assistant|>\n' }}{% elif messages[-1]['role'] == 'assistant' %}{% generation %}{{ eos_token }}"
             "{% endgeneration %}{% else %}{{ eos_token }}{% endif %}"),
    "mistral": ("</s>", ["system"],
                "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + "
                "'[/INST]' }}{% else %}{{ ' ' + m['content'] | trim + eos_token }}{% endif %}{% endfor %}",
                "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + "
                "'[/INST]' }}{% else %}{% generation %}{{ ' ' + m['content'] | trim + eos_token }}{% endgeneration %}"
                "{% endif %}{% endfor %}"),
}
FAMILY_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|end|>", "<|endoftext|>", "<s>", "</s>", "[INST]", "[/INST]"]
BOS = {"llama3": "<|begin_of_text|>", "gemma": "<bos>", "mistral": "<s>"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trained_tokens_equal_trl_assistant_only_loss(tmp_path, family):
    """The tokens we train on each family's own template are the ones TRL's assistant-only loss
    trains with its generation-tagged variant: the answers and what closes each of them, no more."""
    transformers = pytest.importorskip("transformers")
    from make_tiny_chat_model import byte_tokenizer

    from mobius.data.examples import ChatRenderer

    eos, no_roles, shipped, training = FAMILIES[family]
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(FAMILY_SPECIAL), eos_token=eos,
                                               bos_token=BOS.get(family))
    tok.chat_template = shipped
    tok.save_pretrained(str(tmp_path))
    renderer = ChatRenderer(str(tmp_path), None, train_on_prompt=False)
    conversations = [CHAT["messages"], CHAT["messages"][1:3],
                     CHAT["messages"][1:] + [{"role": "user", "content": "Q3"}],
                     [{"role": "user", "content": " spaced "}, {"role": "assistant", "content": " two words \n"}]]
    for messages in conversations:
        messages = [m for m in messages if m["role"] not in no_roles]
        ours = renderer.chat(messages)
        trl = tok.apply_chat_template(messages, chat_template=training, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        assert ours.ids.tolist() == trl["input_ids"], (family, messages)
        assert ours.trained.tolist() == [bool(m) for m in trl["assistant_masks"]], (family, messages)
        assert ours.trained.sum() < ours.trained.size


@pytest.mark.parametrize("content,message", [
    ('{"body": "x"}\n', "bad.jsonl line 1: a record with fields ['body'] is of no known shape; accepted: text;"),
    ('{"messages": [{"role": "user"}]}\n', "messages[0] must be an object with 'role' and 'content'"),
    ('{"conversations": [{"from": "robot", "value": "x"}]}\n', "conversations[0].from 'robot' is none of"),
    ('{"instruction": "x", "output": 3}\n', "'output' must be a string, got int"),
    ('{"text": "a"}\n{"prompt": "p", "completion": "c"}\n', "records of several formats (completion, text)"),
    ('[1, 2]\n', "a record must be a JSON object, got list"),
    ('{"text": "a"\n', "line 1: not valid JSON"),
    ("[" * 100_000 + "\n", "nested too deeply"),
    ('{"messages": [{"role": "user", "content": "q"}]}\n', "'messages' has no assistant turn"),
    ('{"messages": [{"role": "system", "content": "s"}]}\n', "'messages' has no assistant turn"),
    ('{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}\n',
     "'messages' begins with 'assistant'; the user speaks first"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}, '
     '{"role": "assistant", "content": "a"}]}\n', "a system message after the conversation began"),
    ('{"conversations": [{"from": "human", "value": "q"}]}\n', "'conversations' has no assistant turn"),
])
def test_bad_records_are_one_line(tmp_path, capsys, content, message):
    (tmp_path / "bad.jsonl").write_text(content)
    assert message in one_line_exit_2(train_main, SINGLE + ["--data", str(tmp_path / "bad.jsonl")], capsys)


def test_bad_files_and_pairings_are_one_line(tmp_path, capsys):
    (tmp_path / "notlist.json").write_text('{"text": "x"}')
    (tmp_path / "data.arrow").write_bytes(b"ARROW1\x00\x00")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 10)
    chat = write_jsonl(tmp_path / "chat.jsonl", [CHAT])
    cases = [
        (["--data", str(tmp_path / "notlist.json")], "a .json data file must hold a list of records"),
        (["--data", str(tmp_path / "data.arrow")], "an Arrow file; give the directory datasets.save_to_disk wrote"),
        (["--data", str(tmp_path / "blob.bin")], "a binary file, not text or records"),
        (["--data", str(chat)], "chat and instruction data need a Hugging Face model with a tokenizer"),
        (["--data", str(chat), "--data-format", "alpaca"], "--data-format alpaca needs instruction, output"),
        (["--data", str(chat), "--eval-every", "2"], "--eval-every needs --eval-data PATH or --eval-split"),
        (["--eval-split", "0.1"], "--eval-split holds out part of --data"),
        (["--data", str(chat), "--eval-split", "1.5"], "--eval-split must be at least 0 and below 1"),
        (["--data", str(chat), "--chat-template", str(tmp_path / "none.jinja")], "--chat-template"),
    ]
    for argv, message in cases:
        assert message in one_line_exit_2(train_main, SINGLE + argv, capsys), argv


def test_model_without_template_or_tokenizer_and_too_long_examples(tmp_path, capsys):
    pytest.importorskip("transformers")
    from make_tiny_chat_model import make_tiny_chat_model

    model = make_tiny_chat_model(tmp_path / "m", hidden=32, layers=2)
    chat = write_jsonl(tmp_path / "chat.jsonl", [CHAT])
    run = ["--model", str(model), "--seq-len", "16", "--steps", "1", "--backend", "single", "--no-progress"]
    capsys.readouterr()  # transformers' own output while saving the model
    assert "--seq-len 16 + 1 (--no-truncate)" in one_line_exit_2(
        train_main, run + ["--data", str(chat), "--no-truncate"], capsys)
    (model / "chat_template.jinja").unlink()
    assert "give one with --chat-template FILE" in one_line_exit_2(train_main, run + ["--data", str(chat)], capsys)
    (model / "tokenizer.json").unlink()
    assert "no tokenizer (tokenizer.json or tokenizer.model)" in one_line_exit_2(
        train_main, run + ["--data", str(chat)], capsys)


def test_truncation_is_counted(tmp_path):
    from mobius.data.examples import Example
    from mobius.data.packing import pack

    import numpy as np

    long = Example(np.arange(40), np.ones(40, dtype=bool))
    short = Example(np.arange(5), np.ones(5, dtype=bool))
    packed = pack([long, short, short], 16, True, seed=0)
    assert packed.truncated == 1 and packed.examples == 3
    with pytest.raises(InputError, match="example 0 has 40 tokens"):
        pack([long], 16, True, seed=0, truncate=False)


def test_sentencepiece_only_directory_trains_through_transformers(tmp_path, capsys):
    """A model directory with only SentencePiece's tokenizer.model: read by transformers, named in
    the header, its EOS between documents."""
    import io

    spm = pytest.importorskip("sentencepiece")
    transformers = pytest.importorskip("transformers")
    from mobius.data import tokenizer_for

    text = ["hello world", "again hello", "the quick brown fox jumps over the lazy dog"] * 50
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=model, vocab_size=40, model_type="bpe",
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "tokenizer.model").write_bytes(model.getvalue())
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(str(tmp_path / "m"))
    tok = tokenizer_for(str(tmp_path / "m"))
    assert tok.eos_id == 2 and tok.decode(tok.encode("hello world")) == "hello world"
    (tmp_path / "d.txt").write_text(" ".join(text))
    capsys.readouterr()
    train_main(["--model", str(tmp_path / "m"), "--data", str(tmp_path / "d.txt"), "--backend", "single",
                "--steps", "2", "--seq-len", "16", "--micro-batch-size", "2", "--no-progress"])
    assert "; tokenizer tokenizer.model of m" in capsys.readouterr().out


def test_a_datasets_directory_naming_a_file_outside_it_is_refused(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [RECORDS["alpaca"]]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "outside"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    state = tmp_path / "saved" / "state.json"
    d = json.loads(state.read_text())
    arrow = d["_data_files"][0]["filename"]
    d["_data_files"][0]["filename"] = f"../outside/{arrow}"
    state.write_text(json.dumps(d))
    with pytest.raises(InputError, match="outside the directory; refusing to read it"):
        read_examples(tmp_path / "saved")


def test_jsonl_records_end_at_newlines_only(tmp_path):
    """U+2028 and a form feed inside a JSON string are text, not line ends."""
    record = {**RECORDS["alpaca"], "output": "one\u2028two\x0cthree"}
    (tmp_path / "d.jsonl").write_text(json.dumps(record, ensure_ascii=False) + "\r\n")
    records, fmt = read_examples(tmp_path / "d.jsonl")
    assert fmt == "alpaca" and records[0].messages[1]["content"] == "one\u2028two\x0cthree"


def test_a_template_that_raises_an_empty_message_is_one_line(tmp_path, capsys):
    """``raise_exception('')`` says nothing: the line names the error's kind (formatting it failed
    with an IndexError)."""
    pytest.importorskip("transformers")
    from make_tiny_chat_model import make_tiny_chat_model

    model = make_tiny_chat_model(tmp_path / "m", hidden=32, layers=2)
    chat = write_jsonl(tmp_path / "chat.jsonl", [CHAT])
    run = ["--model", str(model), "--data", str(chat), "--seq-len", "128", "--steps", "1", "--backend", "single",
           "--no-progress"]
    capsys.readouterr()  # transformers' own output while saving the model
    (tmp_path / "raises.jinja").write_text("{{ raise_exception('') }}")
    assert "refuses a conversation: TemplateError" in one_line_exit_2(
        train_main, run + ["--chat-template", str(tmp_path / "raises.jinja")], capsys)


def test_a_template_that_loops_for_ever_is_refused_within_its_time_limit(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    from make_tiny_chat_model import make_tiny_chat_model

    from mobius.data import examples

    monkeypatch.setattr(examples, "RENDER_LIMIT_S", 0.5)
    model = make_tiny_chat_model(tmp_path / "m", hidden=32, layers=2)
    chat = write_jsonl(tmp_path / "chat.jsonl", [CHAT])
    capsys.readouterr()  # transformers' own output while saving the model
    (tmp_path / "loops.jinja").write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                          "{% endfor %}")
    message = one_line_exit_2(train_main, ["--model", str(model), "--data", str(chat), "--seq-len", "128", "--steps",
                                           "1", "--backend", "single", "--no-progress", "--chat-template",
                                           str(tmp_path / "loops.jinja")], capsys)
    assert "took more than 0.5 s to render one conversation" in message


def test_each_bad_record_is_refused_with_its_line_or_skipped_and_counted(tmp_path, capsys):
    """A chat record with no answer, one whose roles are out of order, one with an empty answer
    and a line that is no JSON: each refused naming its line and reason, exit 2, before anything
    is written; with --skip-bad-records the run trains on the rest and says how many it left out
    and why the first was."""
    pytest.importorskip("transformers")
    from make_tiny_chat_model import make_tiny_chat_model

    model = make_tiny_chat_model(tmp_path / "m", hidden=32, layers=2)
    capsys.readouterr()  # (transformers' progress while it saved the model)
    good = json.dumps(CHAT)
    bad = {"no answer": ('{"messages": [{"role": "user", "content": "q"}]}', "has no assistant turn"),
           "order": ('{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}',
                     "begins with 'assistant'; the user speaks first"),
           "empty answer": ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}',
                            "is an empty assistant turn: nothing to train on"),
           "not json": ('{"messages": [', "not valid JSON")}
    args = ["--model", str(model), "--seq-len", "64", "--micro-batch-size", "2", "--steps", "1", "--no-progress",
            "--backend", "single"]
    for name, (line, reason) in bad.items():
        data = tmp_path / f"{name}.jsonl"
        data.write_text("\n".join([good, "", good, line, good]) + "\n")  # the bad record on line 4
        out = tmp_path / f"{name}-metrics.jsonl"
        message = one_line_exit_2(train_main, args + ["--data", str(data), "--metrics", str(out)], capsys)
        assert f"{data.name} line 4: " in message and reason in message, message
        assert not out.exists()
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join([good] * 3 + [line for line, _ in bad.values()]) + "\n")
    train_main(args + ["--data", str(mixed), "--skip-bad-records"])
    said = capsys.readouterr().out
    assert "3 chat examples" in said and "4 bad records skipped (the first: --data " in said, said
    assert "mixed.jsonl line 4: 'messages' has no assistant turn" in said


def test_an_end_of_text_token_past_the_models_vocabulary_is_one_line(tmp_path, capsys):
    """The tokenizer's EOS is an id the model's embedding has no row for: it is the last target of
    each example only (never an input), and still refused in one line before anything trains."""
    pytest.importorskip("transformers")
    from make_tiny_chat_model import make_tiny_chat_model
    from tokenizers import Tokenizer

    model = make_tiny_chat_model(tmp_path / "m", hidden=32, layers=2)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tokenizer.add_special_tokens(["<|end|>"])
    assert tokenizer.token_to_id("<|end|>") == vocab
    tokenizer.save(str(model / "tokenizer.json"))
    settings = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(dict(settings, eos_token="<|end|>")))
    (model / "generation_config.json").unlink()
    completions = write_jsonl(tmp_path / "completions.jsonl", [RECORDS["completion"]])  # text ends with EOS
    capsys.readouterr()
    message = one_line_exit_2(train_main, ["--model", str(model), "--data", str(completions), "--seq-len", "128", "--steps",
                                           "1", "--backend", "single", "--no-progress", "--save", str(tmp_path / "ck")],
                              capsys)
    assert f"has a vocabulary of {vocab}, but the data has token id {vocab} (tokenizer.json of m)" in message
    assert not (tmp_path / "ck").exists()


def test_data_whose_answers_truncation_cuts_away_is_refused_before_training(tmp_path, capsys):
    """Every answer past --seq-len: nothing would train (the loss 0, weight decay alone moving the
    weights); refused in one line saying how many examples lost their answer."""
    long = [{"prompt": "a prompt that goes on " * 4, "completion": "yes"}, {"prompt": "and on " * 8, "completion": "no"}]
    data = write_jsonl(tmp_path / "long.jsonl", long)
    message = one_line_exit_2(train_main, SINGLE + ["--data", str(data), "--seq-len", "16"], capsys)
    assert "none of its 2 examples has a token to train on: 2 of them lost their whole answer to truncation" in message
