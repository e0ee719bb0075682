"""Checkpoints: exact, verifiable, safe to load, and never half-written.

A checkpoint is a directory:

* ``manifest.json``: the run's identity (model config, seed, batch shape, total steps), the number
  of completed steps (which is also the data position: batches are a pure function of
  ``(seed, step)``), the fp16 loss scaler, and the SHA-256 of every other file;
* safetensors files of fp32 master weights (under LoRA only the adapters: the base weights are
  the model's own and never change), AdamW state (``exp_avg/<name>``, ``exp_avg_sq/<name>``,
  ``step/<name>``) and RNG states, named by parameter (``layers.<i>.<param>``); with
  ``--optimizer-lag 1`` also the weights the next step computes with (``lagged/<name>``, one
  update behind the master weights).  One backend writes
  one file per kind, and the pipeline one file per stage.  A reader reassembles them by name, so a
  checkpoint from any backend or topology resumes on any other.

Nothing is unpickled: tensors come from safetensors and metadata from JSON.  The manifest carries
a SHA-256 over its own content, so an edited step or a file removed together with its entry is
refused, and a checkpoint must hold every tensor a resume needs (weights, AdamW state, RNG).

Files are written into a staging directory of ours and swapped into place only when complete
(:func:`mobius.boundary.ownership.swap_into_place`).  A crash mid-save leaves the previous checkpoint in
``DIR`` (or, between the two renames, in ``.DIR.mobius-previous``, which loading falls back to).
Only directories that carry our marker are ever removed or replaced.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mobius.boundary import ownership
from mobius.boundary.checks import read_json
from mobius.boundary.errors import InputError, RunError, shown
from mobius.config.sources import stored_config
from mobius.models import GPTConfig, build_model
from mobius.runtime.device import rng_states, set_rng_states

FORMAT = "mobius-checkpoint-2"
MANIFEST = "manifest.json"
KIND = "checkpoint"
# Settings that change the numbers of the rest of a run: a resume that changes one is refused
# unless the user says so (--resume-with-changes).
RUN_SETTINGS = ("seed", "micro_batch_size", "micro_batches", "seq_len", "data", "lr", "steps", "precision",
                "optimizer_lag", "data_format", "packing", "train_on_prompt", "chat_template", "truncate", "eval_split",
                "adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "lr_scheduler", "warmup_ratio", "warmup_steps",
                "min_lr_ratio", "max_grad_norm", "objective", "beta", "label_smoothing", "loss_type")
# Settings added after checkpoints of this format were first written, with the value they had (the
# update rule before it could be set: no clipping).
SETTING_DEFAULTS = {"optimizer_lag": 0, "data_format": None, "packing": "auto", "train_on_prompt": False,
                    "chat_template": None, "truncate": True, "eval_split": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.95,
                    "adam_eps": 1e-8, "weight_decay": 0.01, "lr_scheduler": "cosine", "warmup_ratio": 0.1,
                    "warmup_steps": None, "min_lr_ratio": 0.1, "max_grad_norm": 0.0, "objective": "sft", "beta": 0.1,
                    "label_smoothing": 0.0, "loss_type": "sigmoid"}
# What the schedules' names mean (lr_scheduler, warmup_*): transformers.get_scheduler's.  A checkpoint
# without this mark was written when "cosine" and "linear" decayed to --min-lr-ratio and a warm-up
# started above 0.
LR_SCHEDULES = "transformers"
# With --optimizer-lag 1 the weights the next step computes with (one update behind the master
# weights stored by name) are stored as LAGGED + name.
LAGGED = "lagged/"


class CheckpointError(InputError):
    """A checkpoint that cannot be used: the message names the file and the problem."""


@contextlib.contextmanager
def save_errors(directory: str | os.PathLike, staging: Path):
    """A failed write is one line; the previous checkpoint is untouched because nothing is swapped
    in until the new one is complete, and the half-written ``staging`` directory (ours) goes."""
    try:
        with ownership.writing("the checkpoint", directory, "the previous checkpoint is intact (--resume it)"):
            yield
    except RunError:
        with contextlib.suppress(OSError, InputError):
            ownership.remove(staging, KIND)
        raise


def manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def staging_dir(directory: str | os.PathLike) -> Path:
    return ownership.sibling(directory, "partial")


def begin_save(directory: str | os.PathLike) -> Path:
    """A fresh staging directory (the leftovers of a save that crashed are ours and go)."""
    with save_errors(directory, staging_dir(directory)):
        return ownership.fresh_dir(staging_dir(directory), KIND)


def write_tensors(staging: Path, filename: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    if tensors:
        with save_errors(staging, staging):
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(staging / filename))


def finish_save(directory: str | os.PathLike, staging: Path, meta: dict) -> None:
    """Checksum every file, write the manifest (with its own digest), fsync, and swap the
    directory into place."""
    with save_errors(directory, staging):
        files = {f.name: ownership.sha256_of(f) for f in sorted(staging.iterdir()) if f.is_file() and f.name != ownership.MARKER}
        manifest = {"format": FORMAT, **meta, "files": files}
        manifest["digest"] = manifest_digest(manifest)
        with open(staging / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        for name in files:
            with open(staging / name, "rb") as f:
                os.fsync(f.fileno())
        ownership.swap_into_place(staging, directory, KIND, known_digests=files)


def save(directory: str | os.PathLike, files: dict[str, dict[str, torch.Tensor]], meta: dict, rank: int = 0,
         barrier=lambda: None) -> None:
    """The one way a checkpoint is written, by one process or by every worker of a run: rank 0
    opens the staging directory, each process writes its ``files`` (file name -> tensors by name;
    a pipeline worker its stages' shards, the chunked engine's rank 0 the gathered whole), rank 0
    adds the RNG states, checksums everything and swaps the checkpoint in.  ``barrier`` holds the
    processes together between those phases.  Weights or AdamW state that are not finite (a
    run that diverged on the step just done: no later loss shows it) are never saved."""
    for tensors in files.values():
        bad = next((name for name, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all())),
                   None)
        if bad is not None:
            kept = "the checkpoint there stays as it was" if Path(directory).exists() else "nothing is saved"
            raise RunError(f"--save {shown(directory)}: after step {meta.get('step')} {bad} holds values that are not "
                           f"finite (the update diverged; try a lower --lr or --max-grad-norm 1): {kept}")
    staging = staging_dir(directory)
    if rank == 0:
        begin_save(directory)
    barrier()
    for name, tensors in files.items():
        write_tensors(staging, name, tensors)
    if rank == 0:
        write_tensors(staging, "rng.safetensors", rng_tensors())
    barrier()
    if rank == 0:
        finish_save(directory, staging, meta)
    barrier()


def resume(ckpt: "Checkpoint", restore_state, scaler, precision: str) -> int:
    """The one way a run continues from ``ckpt``: the backend's tensors (``restore_state(ckpt)``),
    the fp16 loss scaler, the RNG states; returns the number of steps done."""
    restore_state(ckpt)
    restore_scaler(ckpt, scaler, precision)
    restore_rng(ckpt)
    return ckpt.step


def check_save_target(cfg) -> None:
    """Pre-flight for ``--save``: a new or empty directory, or the checkpoint this run resumes
    (another run's checkpoint is never replaced), and staging siblings that are ours."""
    if not cfg.checkpoint.save:
        return
    ownership.check_swapped_dir("--save", cfg.checkpoint.save, KIND, replaced=False)
    target = Path(cfg.checkpoint.save).resolve()
    has_checkpoint = target.is_dir() and any(target.iterdir())
    if not has_checkpoint:
        return
    in_place = bool(cfg.checkpoint.resume) and Path(cfg.checkpoint.resume).resolve() == target
    # Continuing in place, the resume checks every byte against the manifest before training.
    ownership.check_removable(target, KIND, "--save", content=not in_place)
    if not in_place:
        raise InputError(f"--save {cfg.checkpoint.save}: holds the checkpoint of another run; continue it with "
                         f"--resume {cfg.checkpoint.save} or save to a new directory")


@dataclass
class Checkpoint:
    directory: Path
    manifest: dict
    _index: dict[str, Path]
    _verified: set = field(default_factory=set)  # files whose bytes matched the manifest when read
    _shapes: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)  # name -> (shape, dtype), as stored

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def tracker_runs(self) -> dict[str, str]:
        """The tracker runs (``--report-to``) its run logged into, by tracker: a resume continues them."""
        runs = self.manifest.get("tracker_runs")
        return {k: v for k, v in runs.items() if isinstance(k, str) and isinstance(v, str)} \
            if isinstance(runs, dict) else {}

    def names(self) -> set[str]:
        return set(self._index)

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._index:
            raise CheckpointError(f"checkpoint {self.directory}: tensor {name!r} is missing")
        path = self._index[name]
        if path not in self._verified:  # every process checks what it reads, when it reads it
            if ownership.sha256_of(path) != self.manifest["files"][path.name]:
                raise CheckpointError(f"checkpoint {self.directory}: {path} is corrupt (checksum mismatch)")
            self._verified.add(path)
        with safe_open(str(path), framework="pt") as h:
            tensor = h.get_tensor(name)
        # Values a run of ours never writes: refused before they reach an optimizer.
        if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
            raise CheckpointError(f"checkpoint {self.directory}: tensor {name!r} holds values that are not finite")
        if name.startswith("exp_avg_sq/") and bool((tensor < 0).any()):
            raise CheckpointError(f"checkpoint {self.directory}: tensor {name!r} holds negative values (AdamW's "
                                  "second moment is a mean of squares)")
        return tensor

    def check_tensors(self, trained: dict[str, tuple[int, ...]]) -> None:
        """Every tensor a resume reads of the ``trained`` parameters (name -> shape) has the
        parameter's shape and a floating dtype (AdamW's moments fp32, its step one number), before
        anything is allocated from it: a crafted checkpoint's short moment would have the fused
        AdamW write past its tensor.  The random generators' states have this build's size."""
        kinds = ["", "exp_avg/", "exp_avg_sq/"] + ([LAGGED] if self.manifest.get("optimizer_lag") else [])
        for param, shape in trained.items():
            for kind in kinds + ["step/"]:
                name = kind + param
                if name not in self._shapes:
                    continue  # missing ones are check_compatible's to name
                got, dtype = self._shapes[name]
                want = (1,) if kind == "step/" else tuple(shape)
                floats = ("F32",) if kind.startswith("exp_avg") else ("F32", "BF16", "F16", "F64")
                if (math.prod(got) != 1 if kind == "step/" else got != want) or dtype not in floats:
                    raise CheckpointError(f"--resume {self.directory}: tensor {name!r} is {dtype} of shape "
                                          f"{list(got)}; the model's is {'/'.join(floats)} of shape {list(want)}")
        for name, state in rng_states().items():  # the generators' states have this build's size
            if name in self._shapes and self._shapes[name] != ((state.numel(),), "U8"):
                got, dtype = self._shapes[name]
                raise CheckpointError(f"--resume {self.directory}: tensor {name!r} is {dtype} of shape {list(got)}; "
                                      f"a random generator's state is U8 of shape [{state.numel()}]")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def load_checkpoint(directory: str | os.PathLike, verify: bool = True) -> Checkpoint:
    """Open and verify a checkpoint; any problem is a :class:`CheckpointError` naming the file.
    ``verify``: every file's checksum now (the launcher, before any worker starts); otherwise each
    file is checked when a tensor is first read from it (:meth:`Checkpoint.get`)."""
    d = Path(directory)
    if not (d / MANIFEST).is_file():
        old = ownership.sibling(d, "previous")
        if (old / MANIFEST).is_file():
            d = old  # a crash between the two renames of a save
        elif d.is_dir() or d.exists():
            raise CheckpointError(f"--resume {directory}: {d / MANIFEST} is missing: not a complete checkpoint")
        else:
            raise CheckpointError(f"--resume {directory}: no such checkpoint directory")
    try:
        manifest = read_json(d / MANIFEST)
    except InputError as err:
        raise CheckpointError(f"--resume {directory}: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"--resume {directory}: {d / MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("digest") != manifest_digest(manifest):
        raise CheckpointError(f"--resume {directory}: {d / MANIFEST} was modified after it was written "
                              "(its digest does not match)")
    for key, value in SETTING_DEFAULTS.items():
        manifest.setdefault(key, value)
    for key in ("step", "model_config", *RUN_SETTINGS):
        if key not in manifest:
            raise CheckpointError(f"--resume {directory}: {d / MANIFEST} lacks {key!r}")
    # The numbers a resume continues from (2.5 steps would resume with the wrong data; a loss
    # scale of 0 or "x" would fail at the first step with raw exception text).
    for key, valid, what in (("step", _count, "a non-negative integer"),
                             ("loss_scale_clean_steps", _count, "a non-negative integer"),
                             ("skipped_steps", _count, "a non-negative integer"),
                             ("loss_scale", _positive_number, "a positive finite number")):
        if key in manifest and not valid(manifest[key]):
            raise CheckpointError(f"--resume {directory}: {d / MANIFEST}: {key} must be {what}, got "
                                  f"{str(manifest[key])[:40]!r}")
    index: dict[str, Path] = {}
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    verified: set = set()
    from safetensors import safe_open

    for name, digest in manifest["files"].items():
        # Confinement: a manifest names plain files of its own directory, never a path out of it.
        if not isinstance(name, str) or not isinstance(digest, str) or Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"--resume {directory}: {d / MANIFEST} names {name!r}, not a file of the checkpoint")
        path = d / name
        if path.is_symlink():
            raise CheckpointError(f"--resume {directory}: {path} is a symbolic link, not a file of the checkpoint")
        if not path.is_file():
            raise CheckpointError(f"--resume {directory}: {path} is missing")
        if verify:
            if ownership.sha256_of(path) != digest:
                raise CheckpointError(f"--resume {directory}: {path} is corrupt (checksum mismatch)")
            verified.add(path)
        if name.endswith(".safetensors"):
            try:
                with safe_open(str(path), framework="pt") as h:
                    for key in h.keys():
                        index[key] = path
                        tensor = h.get_slice(key)
                        shapes[key] = (tuple(tensor.get_shape()), tensor.get_dtype())
            except Exception as err:  # safetensors raises its own error types
                raise CheckpointError(f"--resume {directory}: {path} is not a safetensors file ({err})") from None
    return Checkpoint(d, manifest, index, verified, shapes)


def _setting(cfg, key: str):
    value = cfg.option(key)
    if key in ("data", "chat_template") and value is not None:
        return str(Path(value).resolve())  # the same file however the path was spelled
    if key == "max_grad_norm":
        return float(value or 0.0)  # unset in a configuration built in code: no clipping, as 0
    return value


def check_compatible(ckpt: Checkpoint, model_config: dict, cfg, param_names: set[str]) -> None:
    """The checkpoint must be of this model, hold every tensor a resume needs, and have been taken
    with this run's settings (unless ``cfg.checkpoint.resume_with_changes``)."""
    theirs = ckpt.manifest["model_config"]
    # As the manifest holds it: through JSON, where a tuple (rope scaling, sliding layers) is a list.
    mine = json.loads(json.dumps({k: v for k, v in model_config.items() if k != "checkpoint"}))
    theirs = {k: v for k, v in theirs.items() if k != "checkpoint"} if isinstance(theirs, dict) else {}
    if theirs:  # a field added to the model's shape since the checkpoint was written has its default there
        theirs = {**{k: v for k, v in GPTConfig.defaults().items() if k in mine}, **theirs}
        theirs = json.loads(json.dumps(theirs))
        if isinstance(theirs.get("lora_targets"), str):  # written when the targets were one comma-joined string
            theirs["lora_targets"] = [t for t in theirs["lora_targets"].split(",") if t]
    if theirs != mine:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise CheckpointError(f"--resume {ckpt.directory}: checkpoint is of a different model (differs in {', '.join(diff)})")
    kinds = ("", "exp_avg/", "exp_avg_sq/", "step/") + ((LAGGED,) if ckpt.manifest["optimizer_lag"] else ())
    needed = {f"{kind}{name}" for name in param_names for kind in kinds}
    missing = sorted(needed - ckpt.names()) + ([] if "rng/torch_cpu" in ckpt.names() else ["rng/torch_cpu"])
    if missing:
        raise CheckpointError(f"--resume {ckpt.directory}: incomplete checkpoint: {len(missing)} tensors missing "
                              f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    changed = [f"--{k.replace('_', '-')} {ckpt.manifest[k]!r} -> {_setting(cfg, k)!r}"
               for k in RUN_SETTINGS if ckpt.manifest[k] != _setting(cfg, k)]
    if ckpt.manifest.get("lr_schedules") != LR_SCHEDULES and not cfg.checkpoint.resume_with_changes:
        raise CheckpointError(f"--resume {ckpt.directory}: the checkpoint's run used Mobius' earlier learning-rate "
                              "schedules (cosine and linear decayed to --min-lr-ratio, a warm-up started above 0); "
                              "pass --resume-with-changes to continue on transformers' schedule of its settings")
    if changed and not cfg.checkpoint.resume_with_changes:
        raise CheckpointError(f"--resume {ckpt.directory}: this run changes settings of the checkpoint's run "
                              f"({'; '.join(changed)}); pass --resume-with-changes to apply them")
    if ckpt.step > cfg.optim.steps:
        raise CheckpointError(f"--resume {ckpt.directory}: checkpoint is at step {ckpt.step}, "
                              f"beyond --steps {cfg.optim.steps}")


def resumed_checkpoint(cfg) -> "Checkpoint | None":
    """The checkpoint ``--resume`` names (the launcher checked it; each file is checked as it is
    read), or None."""
    return load_checkpoint(cfg.checkpoint.resume, verify=False) if cfg.checkpoint.resume else None


def open_for_resume(cfg, model_config) -> Checkpoint:
    """``--resume``: the verified checkpoint, checked against this run (model, tensors, settings)."""
    ckpt = load_checkpoint(cfg.checkpoint.resume)
    trained = {n: tuple(p.shape) for n, p in build_model(model_config, device="meta").named_parameters()
               if p.requires_grad}
    check_compatible(ckpt, model_config.to_dict(), cfg, set(trained))
    ckpt.check_tensors(trained)
    return ckpt


def _tree_digest(path: Path, pattern: str = "*") -> str:
    """SHA-256 over the names and contents of ``path`` (a file, or the files under a directory
    matching ``pattern``, hidden ones aside)."""
    if path.is_file():
        return ownership.sha256_of(path)
    files = sorted(f for f in path.rglob(pattern) if f.is_file() and not any(
        part.startswith(".") for part in f.relative_to(path).parts))
    listing = [(str(f.relative_to(path)), ownership.sha256_of(f)) for f in files]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()


def input_digests(cfg, model_config) -> dict[str, str]:
    """SHA-256s of what the run trains from, recorded in its checkpoints: the data, the chat
    template, and the base weights of a Hugging Face model (LoRA trains on them; a full fine-tune
    starts from them).  Computed once, by the launching process, and only for a run that saves
    or resumes."""
    if not (cfg.checkpoint.save or cfg.checkpoint.resume):
        return {}
    found = {}
    if cfg.data.path:
        found["data"] = _tree_digest(Path(cfg.data.path))
    if cfg.data.chat_template:
        found["chat template"] = _tree_digest(Path(cfg.data.chat_template))
    if model_config.checkpoint:
        found["base weights"] = _tree_digest(Path(model_config.checkpoint), "*.safetensors")
    return found


def check_inputs(cfg, digests: dict[str, str]) -> None:
    """A resume trains from the inputs its checkpoint was trained from, unless the user says
    otherwise (``--resume-with-changes``, which says what changed)."""
    ckpt = load_checkpoint(cfg.checkpoint.resume, verify=False)
    recorded = ckpt.manifest.get("inputs")
    recorded = recorded if isinstance(recorded, dict) else {}
    changed = [what for what, digest in digests.items() if what in recorded and recorded[what] != digest]
    if not changed:
        return
    what = " and ".join(changed)
    if not cfg.checkpoint.resume_with_changes:
        raise CheckpointError(f"--resume {ckpt.directory}: the {what} changed since the checkpoint was written "
                              "(SHA-256 differs); pass --resume-with-changes to train on them as they are now")
    print(f"note: resuming with changed {what} (--resume-with-changes)", flush=True)


def run_config(directory: str) -> dict:
    """The resolved configuration of the run a checkpoint continues (empty for older checkpoints)."""
    return dict(load_checkpoint(directory, verify=False).manifest.get("config") or {})


def run_meta(cfg, model_config: dict, step: int, scaler, inputs: dict[str, str] | None = None,
             tracker_runs: dict[str, str] | None = None) -> dict:
    """The manifest's account of the run: its settings (checked on resume), the digests of its
    inputs (:func:`input_digests`), its whole resolved configuration (``--resume DIR`` alone
    continues with it) and the tracker runs it logs into (a resume continues them)."""
    return {"step": step, "model": cfg.model, "model_config": model_config, "backend": cfg.backend,
            "tracker_runs": tracker_runs or {},
            "inputs": inputs or {},
            **{k: _setting(cfg, k) for k in RUN_SETTINGS}, "lr_schedules": LR_SCHEDULES,
            "config": stored_config(cfg.to_dict()),
            "loss_scale": scaler.scale, "loss_scale_clean_steps": scaler.clean_steps,
            "skipped_steps": scaler.skipped_steps}


def optimizer_tensors(named_params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> dict:
    out = {}
    for name, p in named_params.items():
        state = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key in state:
                value = state[key]
                out[f"{key}/{name}"] = value if torch.is_tensor(value) else torch.tensor(float(value))
    return out


def restore(ckpt: Checkpoint, named_params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer,
            aliases: dict[str, str] | None = None) -> None:
    """Weights for ``named_params``, and AdamW state for those ``optimizer`` updates (under data
    parallelism, a replica's share; None: none); ``aliases`` maps a tied copy to the stored name."""
    aliases = aliases or {}
    updated = {id(p) for group in optimizer.param_groups for p in group["params"]} if optimizer else set()
    with torch.no_grad():
        for name, p in named_params.items():
            stored = aliases.get(name, name)
            value = ckpt.get(stored)
            if value.shape != p.shape:
                raise CheckpointError(f"--resume {ckpt.directory}: {stored} has shape {tuple(value.shape)}, "
                                      f"the model has {tuple(p.shape)}")
            p.copy_(value)
            if id(p) not in updated:
                continue
            optimizer.state[p] = {"step": ckpt.get(f"step/{stored}").clone(),
                                  "exp_avg": ckpt.get(f"exp_avg/{stored}").clone(),
                                  "exp_avg_sq": ckpt.get(f"exp_avg_sq/{stored}").clone()}


def lagged_weights(ckpt: Checkpoint, name: str, lag: int) -> torch.Tensor:
    """The weights step ``ckpt.step`` computes with: one update behind when the checkpoint's run and
    this one both lag, else the master weights (a resume that switches the lag starts from them)."""
    if lag and ckpt.manifest["optimizer_lag"]:
        return ckpt.get(LAGGED + name)
    return ckpt.get(name)


def rng_tensors() -> dict[str, torch.Tensor]:
    return rng_states()


def restore_rng(ckpt: Checkpoint) -> None:
    set_rng_states({name: ckpt.get(name) for name in ckpt.names() if name.startswith("rng/")})


def restore_scaler(ckpt: Checkpoint, scaler, precision: str) -> None:
    """The fp16 loss scaler continues where it was; a run that switches precision starts afresh."""
    if ckpt.manifest["precision"] != precision:
        return
    scaler.scale = float(ckpt.manifest.get("loss_scale", scaler.scale))
    scaler.clean_steps = int(ckpt.manifest.get("loss_scale_clean_steps", 0))
    scaler.skipped_steps = int(ckpt.manifest.get("skipped_steps", 0))
