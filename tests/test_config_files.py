"""Settings from a YAML file and from the checkpoint a run resumes, under the command line's."""

import json

import pytest

from mobius.config import parse_train_args
from mobius.train import main as train_main
from conftest import TINY, one_line_exit_2

RUN = ["--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--micro-batches", "2", "--steps", "6",
       "--backend", "single", "--no-progress", "--lr", "3e-3"]


def losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


def test_config_file_equals_flags_and_the_command_line_wins(tmp_path):
    (tmp_path / "run.yaml").write_text("model: tiny\nseq-len: 32\nmicro_batch_size: 2\nmicro-batches: 2\nsteps: 6\n"
                                       "backend: single\nprogress: false\nlr: 3.0e-3\nseed: 5\n")
    cfg = parse_train_args(["--config", str(tmp_path / "run.yaml"), "--seed", "0"])
    assert (cfg.model, cfg.batch.seq_len, cfg.batch.micro_batch_size, cfg.optim.lr, cfg.optim.seed, cfg.outputs.progress) == \
        ("tiny", 32, 2, 3e-3, 0, False)
    train_main(["--config", str(tmp_path / "run.yaml"), "--seed", "0", "--metrics", str(tmp_path / "a.jsonl")])
    train_main(RUN + ["--metrics", str(tmp_path / "b.jsonl")])
    assert losses(tmp_path / "a.jsonl") == losses(tmp_path / "b.jsonl")  # bitwise


def test_resume_alone_continues_the_run_exactly(tmp_path):
    train_main(RUN + ["--metrics", str(tmp_path / "straight.jsonl")])
    train_main(RUN + ["--stop-after", "3", "--save", str(tmp_path / "ck"), "--metrics", str(tmp_path / "r.jsonl")])
    # Every setting from the checkpoint, and --save into it; where to write metrics is named again.
    train_main(["--resume", str(tmp_path / "ck"), "--metrics", str(tmp_path / "r.jsonl")])
    assert losses(tmp_path / "r.jsonl") == losses(tmp_path / "straight.jsonl")  # bitwise, 6 steps


def test_a_resume_writes_only_where_the_user_names(tmp_path):
    """A checkpoint records where its run wrote metrics and a trace; --resume alone writes neither
    (a checkpoint could name any path), and saves only into itself."""
    ck = tmp_path / "ck"
    outputs = {"--metrics": tmp_path / "m.jsonl", "--trace": tmp_path / "t.json"}
    train_main(RUN + ["--stop-after", "3", "--save", str(ck)] + [str(x) for kv in outputs.items() for x in kv])
    written = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p != ck}
    manifest = (ck / "manifest.json").read_bytes()
    train_main(["--resume", str(ck)])
    assert {p: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p != ck} == written
    assert len(losses(outputs["--metrics"])) == 3
    assert (ck / "manifest.json").read_bytes() != manifest  # the continued run saved into its checkpoint


def test_resume_with_a_changed_setting_is_refused_unless_asked(tmp_path, capsys):
    train_main(RUN + ["--stop-after", "2", "--save", str(tmp_path / "ck")])
    message = one_line_exit_2(train_main, ["--resume", str(tmp_path / "ck"), "--lr", "1e-2"], capsys)
    assert "--lr 0.003 -> 0.01" in message and "--resume-with-changes" in message


def test_defaults_shown_and_printed(capsys):
    with pytest.raises(SystemExit) as info:
        train_main(["--print-config"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "lr: 0.001\n" in out and "packing: auto\n" in out and "steps: 40\n" in out
    # as the run will use them: the backend and precision decided on this machine (no GPU here)
    assert "backend: pipeline\n" in out and "precision: fp32\n" in out and "max_grad_norm: 0.0\n" in out
    with pytest.raises(SystemExit):
        train_main(["--help"])
    assert "(default: 4)" in capsys.readouterr().out  # --micro-batch-size


def test_printed_config_is_yaml_alone_and_reads_back(tmp_path, capsys):
    """``--print-config > x.yaml`` then ``--config x.yaml --print-config`` prints the same: stdout
    holds the YAML alone (the probe's line and anything else said on the way go to stderr)."""
    import yaml

    with pytest.raises(SystemExit):
        train_main(["--topology", "auto", "--lr", "2e-3", "--print-config"])
    first = capsys.readouterr()
    assert "topology: no NVIDIA driver" not in first.out and yaml.safe_load(first.out)["lr"] == 2e-3
    (tmp_path / "x.yaml").write_text(first.out)
    with pytest.raises(SystemExit):
        train_main(["--config", str(tmp_path / "x.yaml"), "--print-config"])
    assert capsys.readouterr().out == first.out


def test_default_learning_rates_and_epochs(tmp_path):
    assert parse_train_args(["--model", "tiny"]).optim.lr == 1e-3
    assert parse_train_args(["--model", "tiny", "--lr", "5e-4"]).optim.lr == 5e-4
    (tmp_path / "config.json").write_text("{}")  # any directory is a Hugging Face model for the default
    assert parse_train_args(["--model", str(tmp_path)]).optim.lr == 2e-5
    assert parse_train_args(["--model", str(tmp_path), "--lora-rank", "8"]).optim.lr == 2e-4
    assert parse_train_args(["--epochs", "2"]).optim.epochs == 2


@pytest.mark.parametrize("content,message", [
    ("lr: [1, 2]\n", "'lr' must be a single value"),
    ("learning_rate: 1\n", "unknown setting 'learning_rate'"),
    ("- lr\n", "must be a mapping of settings, got list"),
    ("lr: 0.1\n  bad: : indent\n", "not valid YAML"),
    ("micro-batches: many\n", "bad.yaml: 'micro-batches' must be an integer, got 'many'"),
    ("packing: sometimes\n", "bad.yaml: 'packing' must be one of auto, on, off, got 'sometimes'"),
    ("lr: fast\n", "bad.yaml: 'lr' must be a number, got 'fast'"),
    ("train-on-prompt: 3\n", "'train-on-prompt' must be true or false"),
])
def test_bad_config_files_are_one_line(tmp_path, capsys, content, message):
    (tmp_path / "bad.yaml").write_text(content)
    assert message in one_line_exit_2(train_main, ["--config", str(tmp_path / "bad.yaml")], capsys)


def test_steps_and_epochs_together_are_refused(capsys):
    assert "give --steps or --epochs, not both" in one_line_exit_2(train_main, ["--steps", "3", "--epochs", "1"],
                                                                    capsys)


@pytest.mark.slow
def test_a_config_that_is_no_regular_file_or_unbounded_is_refused_at_once(tmp_path, capsys):
    """A FIFO would block for ever, an alias bomb expands without bound: both refused in one line,
    before anything is read or expanded; a bad value is echoed short."""
    import os

    os.mkfifo(tmp_path / "fifo.yaml")
    assert "not a regular file" in one_line_exit_2(train_main, ["--config", str(tmp_path / "fifo.yaml")], capsys)
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    (tmp_path / "bomb.yaml").write_text(bomb)
    assert "aliases" in one_line_exit_2(train_main, ["--config", str(tmp_path / "bomb.yaml")], capsys)
    (tmp_path / "long.yaml").write_text(f"lr: [{'1, ' * 100000}1]\n")
    message = one_line_exit_2(train_main, ["--config", str(tmp_path / "long.yaml")], capsys)
    assert "'lr' must be a single value" in message and len(message) < 300


def test_yaml_takes_the_switches_by_their_own_names_and_on_off_as_written(tmp_path):
    (tmp_path / "run.yaml").write_text("model: tiny\nno-progress: true\npacking: off\nrecompute: on\n")
    cfg = parse_train_args(["--config", str(tmp_path / "run.yaml")])
    assert cfg.outputs.progress is False and cfg.data.packing == "off" and cfg.pipeline.recompute == "on"


def test_lists_of_names_are_lists_in_yaml_and_comma_separated_on_the_command_line(tmp_path, capsys):
    """--lora-targets and --report-to are tuples of names: a YAML list or ``a,b`` give the same;
    --print-config shows them as lists, which a --config file reads back."""
    (tmp_path / "run.yaml").write_text("model: tiny\nlora-rank: 4\nlora-targets: [qkv, fc]\n")
    from_file = parse_train_args(["--config", str(tmp_path / "run.yaml")])
    assert from_file.lora.targets == ("qkv", "fc") == parse_train_args(TINY + ["--lora-rank", "4", "--lora-targets",
                                                                               "qkv,fc"]).lora.targets
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parse_train_args(["--config", str(tmp_path / "run.yaml"), "--print-config"])
    printed = capsys.readouterr().out
    assert "lora_targets:\n- qkv\n- fc\n" in printed
    (tmp_path / "printed.yaml").write_text(printed)
    assert parse_train_args(["--config", str(tmp_path / "printed.yaml")]).lora.targets == ("qkv", "fc")


@pytest.mark.slow
def test_resume_in_a_config_file_inherits_the_checkpoints_settings(tmp_path):
    train_main(RUN + ["--metrics", str(tmp_path / "straight.jsonl")])
    train_main(RUN + ["--stop-after", "3", "--save", str(tmp_path / "ck"), "--metrics", str(tmp_path / "r.jsonl")])
    (tmp_path / "resume.yaml").write_text(f"resume: {tmp_path / 'ck'}\nmetrics: {tmp_path / 'r.jsonl'}\n")
    train_main(["--config", str(tmp_path / "resume.yaml")])
    assert losses(tmp_path / "r.jsonl") == losses(tmp_path / "straight.jsonl")


@pytest.mark.slow
def test_a_resume_reads_only_the_files_the_user_names(tmp_path, capsys):
    """The checkpoint records the data file its run read; --resume alone does not read it again
    (a checkpoint could name any file), naming it does."""
    data = tmp_path / "notes.txt"
    data.write_text("some words to train on, " * 400)
    run = RUN + ["--data", str(data), "--packing", "on"]
    train_main(run + ["--stop-after", "3", "--save", str(tmp_path / "ck"), "--metrics", str(tmp_path / "r.jsonl")])
    message = one_line_exit_2(train_main, ["--resume", str(tmp_path / "ck")], capsys)
    assert f"its run read --data {data}; name it (--data PATH) to read it again" in message
    train_main(["--resume", str(tmp_path / "ck"), "--data", str(data), "--metrics", str(tmp_path / "r.jsonl")])
    assert len(losses(tmp_path / "r.jsonl")) == 6


def test_outputs_get_their_parent_directories_which_go_again_when_empty(tmp_path, capsys):
    """``--metrics runs/a/m.jsonl`` and ``--save runs/ck`` with no ``runs/``: made, and kept holding
    the outputs; a run refused before it wrote anything leaves no directory behind."""
    args = ["--model", "tiny", "--seq-len", "16", "--steps", "2", "--no-progress", "--backend", "single"]
    metrics, save = tmp_path / "runs" / "a" / "m.jsonl", tmp_path / "runs" / "ck"
    train_main(args + ["--metrics", str(metrics), "--save", str(save)])
    assert metrics.is_file() and (save / "manifest.json").is_file()
    refused = tmp_path / "other" / "deeper" / "m.jsonl"
    one_line_exit_2(train_main, args + ["--metrics", str(refused), "--lr", "-1"], capsys)
    assert not (tmp_path / "other").exists()
    (tmp_path / "file").write_text("a user's file")
    message = one_line_exit_2(train_main, args + ["--metrics", str(tmp_path / "file" / "m.jsonl")], capsys)
    assert "file is not a directory" in message and (tmp_path / "file").read_text() == "a user's file"


@pytest.mark.slow
def test_a_resume_that_changes_the_update_rule_is_refused_unless_asked(tmp_path, capsys):
    """Clipping, the schedule and AdamW's settings change the numbers of the rest of a run: a
    resume that changes one says which, as for the learning rate."""
    args = ["--model", "tiny", "--seq-len", "16", "--steps", "4", "--no-progress", "--backend", "single"]
    train_main(args + ["--stop-after", "2", "--save", str(tmp_path / "ck"), "--max-grad-norm", "0.5"])
    message = one_line_exit_2(train_main, ["--resume", str(tmp_path / "ck"), "--max-grad-norm", "1",
                                           "--lr-scheduler", "cosine"], capsys)
    assert "--lr-scheduler 'linear' -> 'cosine'" in message and "--max-grad-norm 0.5 -> 1.0" in message
    train_main(["--resume", str(tmp_path / "ck")])  # the checkpoint's own rule: goes on
    out = capsys.readouterr().out
    assert "gradients clipped at a global norm of 0.5" in out
    assert out.rstrip().splitlines()[-1].endswith("; 2 of 2 steps clipped")  # the tiny model's norms are 1-4
