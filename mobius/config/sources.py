"""Where a run's settings come from, lowest first: the checkpoint of ``--resume`` (the resolved
configuration of the run it continues), a ``--config`` YAML file, then the command line.

Each source becomes command-line tokens placed before the user's own, so argparse checks every
value (types, choices) the same way whatever its source, and the last word wins.
"""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

from mobius.boundary.errors import InputError, first_line

# Settings of one invocation, never inherited from a checkpoint's run.
NOT_INHERITED = ("resume", "resume_with_changes", "stop_after", "config", "print_config", "epochs",
                 # where the state waits, and how much memory holds the rest, are the machine's: named
                 # again on the next, or not
                 "offload_dir", "host_mem_gb", "drive_gbps")
# Settings that name files the run reads: a resume takes them from the user, never from the checkpoint.
READ_PATHS = ("model", "data", "eval_data", "chat_template", "topology")
# Settings that name where the run writes: a resume writes only where the user names again (a tampered
# checkpoint must not choose the paths), except --save of the very checkpoint it continues (ours).
WRITE_PATHS = ("metrics", "tensorboard", "report_to", "report_dir", "trace", "save", "export", "export_merged")
# Settings that name files: stored resolved, so a resume from another directory finds them.
PATH_SETTINGS = ("data", "eval_data", "chat_template", "metrics", "tensorboard", "report_dir", "offload_dir", "trace",
                 "save", "export", "export_merged", "topology", "model")


MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 8  # a mapping of settings holds single values: no deep nesting is ever needed


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each switch by its own name (``no_progress`` for ``--no-progress``)."""
    return {o.lstrip("-").replace("-", "_"): a for a in parser._actions
            if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)) for o in a.option_strings}


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def comma_names(text: str) -> tuple[str, ...]:
    """A setting that is a list of names: ``qkv,fc`` on the command line (a list in a YAML file)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def tokens_of(parser: argparse.ArgumentParser, settings: dict, source: str) -> list[str]:
    """``settings`` (option names with ``_`` or ``-``) as command-line tokens for ``parser``.  A
    switch goes by its option's name or its flag's (``progress: false`` or ``no-progress: true``);
    YAML's on/off (read as booleans) are on/off again for options that take them."""
    actions, flags = _actions(parser), _flags(parser)
    out: list[str] = []
    for key, value in settings.items():
        dest = str(key).replace("-", "_")
        action = actions.get(dest)
        if action is None and dest in flags:  # the switch's own name: true means the flag is given
            action = flags[dest]
            if not isinstance(value, bool):
                raise InputError(f"{source}: {_shown(key)} must be true or false, got {_shown(value)}")
            value = action.default if not value else not action.default
        if action is None or dest in ("config", "print_config"):
            raise InputError(f"{source}: unknown setting {_shown(key)} (the settings are the options of "
                             "python -m mobius.train, e.g. lr or micro-batch-size)")
        if value is None:
            continue
        flag = action.option_strings[0]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                raise InputError(f"{source}: {_shown(key)} must be true or false, got {_shown(value)}")
            if value == (not action.default):  # the flag turns the default around
                out.append(flag)
            continue
        if isinstance(value, bool) and action.choices and {"on", "off"} <= set(action.choices):
            value = "on" if value else "off"
        if isinstance(value, list) and action.type is comma_names and all(isinstance(v, str) for v in value):
            value = ",".join(value)  # a list of names, as the command line spells it
        if isinstance(value, (dict, list, bool)):
            raise InputError(f"{source}: {_shown(key)} must be a single value, got {_shown(value)}")
        _check_value(action, str(value), f"{source}: {_shown(key)}")
        out += [flag, str(value)]
    return out


def _check_value(action: argparse.Action, text: str, where: str) -> None:
    """The checks argparse would make of ``text`` for ``action``, said naming the file and key the
    value came from (argparse would name only the option)."""
    try:
        value = action.type(text) if callable(action.type) else text
    except (TypeError, ValueError):
        kind = {int: "an integer", float: "a number"}.get(action.type, "a valid value")
        raise InputError(f"{where} must be {kind}, got {_shown(text)}") from None
    if action.choices is not None and value not in action.choices:
        raise InputError(f"{where} must be one of {', '.join(map(str, action.choices))}, got {_shown(text)}")


def read_yaml(path: str) -> dict:
    import yaml

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or a device would block or never end
            raise InputError(f"--config {path}: not a regular file")
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise InputError(f"--config {path}: cannot read it ({err.strerror})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise InputError(f"--config {path}: larger than {MAX_CONFIG_BYTES // 1024} KiB; a file of settings is a "
                         "few lines")
    try:
        text = raw.decode("utf-8")
        depth = 0  # read as events first: aliases (which can expand without bound) and deep nesting refused
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
                raise InputError(f"--config {path}: YAML aliases (*name) are not accepted in a settings file")
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            if depth > MAX_CONFIG_DEPTH:
                raise InputError(f"--config {path}: nested deeper than {MAX_CONFIG_DEPTH} levels")
        data = yaml.safe_load(text)
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as err:
        raise InputError(f"--config {path}: not valid YAML ({first_line(err, 120)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InputError(f"--config {path}: must be a mapping of settings, got {type(data).__name__}")
    return data


def stored_config(settings: dict) -> dict:
    """The resolved configuration a checkpoint keeps: paths made absolute, per-invocation settings out."""
    out = {k: v for k, v in settings.items() if k not in NOT_INHERITED}
    for key in PATH_SETTINGS:
        value = out.get(key)
        if isinstance(value, str) and Path(value).exists():
            out[key] = str(Path(value).resolve())
    return out


def layered_argv(parser: argparse.ArgumentParser, argv: list[str], checkpoint_settings,
                 backend_options: tuple[str, ...] = ()) -> list[str]:
    """``argv`` behind the tokens of the checkpoint's configuration (``checkpoint_settings(DIR)``)
    and of the ``--config`` file.  A resume on another ``--backend`` inherits none of the
    previous backend's own options (``backend_options``)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--resume")
    pre.add_argument("--backend")
    for name in READ_PATHS:
        pre.add_argument("--" + name.replace("_", "-"), dest=name)
    known, _ = pre.parse_known_args(argv)
    config = tokens_of(parser, read_yaml(known.config), f"--config {known.config}") if known.config else []
    # resume: and backend: in the YAML file act as on the command line (which wins over them).
    from_file, _ = pre.parse_known_args(config)
    resume, backend = known.resume or from_file.resume, known.backend or from_file.backend
    layers: list[str] = []
    if resume and checkpoint_settings is not None:
        stored = checkpoint_settings(resume)
        in_place = bool(stored.get("save")) and Path(str(stored["save"])).resolve() == Path(resume).resolve()
        inherited = {k: v for k, v in stored.items() if k not in NOT_INHERITED
                     and (k not in WRITE_PATHS or (k == "save" and in_place))}
        if backend not in (None, inherited.get("backend")):  # another backend: none of its options
            inherited = {k: v for k, v in inherited.items() if k not in backend_options}
        for name in READ_PATHS:  # a file the run reads is one the user names, not one a checkpoint does
            value = inherited.get(name)
            if value and Path(str(value)).is_absolute() and not (getattr(known, name) or getattr(from_file, name)):
                flag = "--" + name.replace("_", "-")
                raise InputError(f"--resume {resume}: its run read {flag} {value}; name it ({flag} PATH) to read it "
                                 "again, or another")
        layers += tokens_of(parser, {k: v for k, v in inherited.items() if k in _actions(parser)},
                            f"--resume {resume}")
    return layers + config + argv
