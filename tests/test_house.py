"""The house in order: every default stated once (the flags' are the dataclass fields'), and every
module, function or file a docstring or comment names exists."""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("mobius", "chunked_dp", "topology", "scripts") for p in (ROOT / d).rglob("*.py")]


def test_each_test_process_computes_on_its_share_of_the_cores():
    """``tests/conftest.py`` sets ``OMP_NUM_THREADS`` before anything imports torch, so that test
    processes side by side each compute on their share of the cores (with torch imported first,
    each ran a thread per core, and the suite's CPU time grew with their contention)."""
    import os

    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        pytest.skip("one test process: torch's own default")
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])


def test_every_flag_is_generated_from_its_field_with_its_default_and_help():
    """One name, one default, one help text per setting: each flag of ``mobius.train`` (and the
    subset ``mobius.plan`` takes) is its field's; a default that depends on other settings
    (``resolved_when_parsed``) is None on the command line and resolved when it is parsed."""
    from mobius.config import OPTIONS, SECTIONS, RunConfig, build_train_parser
    from mobius.plan import build_parser

    def field_of(option):
        section, attr = OPTIONS.get(option, (None, option))
        kind = SECTIONS[section] if section else RunConfig
        return RunConfig.__dataclass_fields__[attr] if kind is RunConfig else kind.__dataclass_fields__[attr]

    for parser, least in ((build_train_parser(), 60), (build_parser(), 25)):
        checked = 0
        for action in parser._actions:
            if action.dest not in RunConfig().to_dict():
                continue
            f = field_of(action.dest)
            expected = None if f.metadata.get("resolved_when_parsed") else f.default
            assert (action.default, action.help) == (expected, f.metadata["help"]), action.dest
            checked += 1
        assert checked >= least


def _named(text: str) -> set[str]:
    """Dotted names in Sphinx roles (``:mod:`mobius.x```, ``:func:`~mobius.x.f```)."""
    return {m.group(1) for m in re.finditer(r":(?:mod|func|class|data|meth|attr):`~?((?:mobius|chunked_dp|topology)"
                                            r"(?:\.\w+)+)`", text)}


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
        module = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            continue
        obj = importlib.import_module(module)
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_module_and_function_a_docstring_names_exists():
    assert not _resolves("mobius.profiles.get_profile") and _resolves("mobius.planning.prepare.get_profile")
    missing = sorted({(str(p.relative_to(ROOT)), name) for p in SOURCES for name in _named(p.read_text())
                      if not _resolves(name)})
    assert not missing, missing


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md"])
def test_every_source_file_the_docs_name_exists(doc):
    text = (ROOT / doc).read_text()
    named = set(re.findall(r"`((?:mobius|chunked_dp|topology|scripts|tests)/[\w/]+\.py)", text))
    assert named and not sorted(n for n in named if not (ROOT / n).exists())


@pytest.mark.parametrize("cuda, precision", [(False, "fp32"), (True, "bf16")])
def test_the_precision_is_decided_once_and_read_by_every_check_after(monkeypatch, tmp_path, cuda, precision):
    """Unset, the precision is the devices' default: the host-memory check before training counts
    the bytes of the precision the run will train in, not a default of its own."""
    import mobius.backends as backends
    import mobius.planning.prepare as prepare
    import mobius.train as train
    from mobius.boundary.errors import InputError
    from mobius.config import RunConfig

    monkeypatch.setattr(prepare, "cuda_available", lambda: cuda)
    monkeypatch.setattr(train, "available_host_memory", lambda: 2**40)
    decisions = []
    monkeypatch.setattr(backends, "decide", lambda *args, **kwargs: decisions.append(args[2]) or prepare.decide(*args,
                                                                                                            **kwargs))
    checked = []

    def check_host_memory(model, config, precision, *args, **kwargs):
        checked.append(precision)
        raise InputError("checked")

    monkeypatch.setattr(train, "check_host_memory", check_host_memory)
    data = tmp_path / "text.txt"
    data.write_text("the house in order " * 200)
    cfg = RunConfig.of(model="tiny", backend="single", data=str(data), steps=1, seq_len=16, micro_batch_size=1,
                       micro_batches=1)
    with pytest.raises(InputError, match="checked"):
        train.run(cfg)
    assert checked == [precision]
    assert decisions == ["single"]  # one decision record, made before anything reads it


def test_mobius_plan_decides_once_for_the_machine_its_topology_describes(monkeypatch, capsys):
    """``mobius.plan`` makes one decision record, as a run on the topology's own machine makes it
    (its GPUs, the CUDA reserve taken from their memory, bf16), wherever the command runs, and
    plans from it: no function after it decides the devices or the precision again."""
    import json

    import mobius.backends as backends
    import mobius.plan
    import mobius.planning.prepare as prepare
    from mobius.runtime.device import CUDA_RESERVE_BYTES

    made, seen, precisions = [], [], []
    resolve_devices, resolve_precision = prepare.resolve_devices, prepare.resolve_precision
    monkeypatch.setattr(backends, "decide", lambda *a, **k: made.append(prepare.decide(*a, **k)) or made[-1])
    monkeypatch.setattr(prepare, "resolve_devices", lambda *a, **k: seen.append(a) or resolve_devices(*a, **k))
    monkeypatch.setattr(prepare, "resolve_precision", lambda *a: precisions.append(a) or resolve_precision(*a))
    monkeypatch.setattr(prepare, "cuda_available", lambda: False)  # a machine without the topology's GPUs
    mobius.plan.main(["--model", "tiny", "--topology", "4x4090", "--seq-len", "32", "--micro-batches", "4",
                      "--profile", "analytic", "--mip-effort", "1", "--schedule", "auto", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert len(made) == len(seen) == len(precisions) == 1
    decided = made[0]
    assert (decided.backend, decided.gpus, decided.precision, decided.replicas) == ("pipeline", True, "bf16", 1)
    assert not decided.topology.virtual
    assert [g.memory_gb for g in decided.topology.gpus] == pytest.approx([24 - CUDA_RESERVE_BYTES / 1e9] * 4)
    assert out["precision"] == "bf16" and out["profile_source"].startswith("analytic")
