"""Checkpoints: exact, verifiable, safe to load, and never half-written.

A checkpoint is a directory:

* ``manifest.json``: the run's identity (model config, seed, batch shape, total steps), the number
  of completed steps (which is also the data position: batches are a pure function of
  ``(seed, step)``), the fp16 loss scaler, and the SHA-256 of every other file;
* safetensors files of fp32 master weights, AdamW state (``exp_avg/<name>``, ``exp_avg_sq/<name>``,
  ``step/<name>``) and RNG states, named by parameter (``layers.<i>.<param>``).  One backend writes
  one file per kind, and the pipeline one file per stage.  A reader reassembles them by name, so a
  checkpoint from any backend or topology resumes on any other.

Nothing is unpickled: tensors come from safetensors and metadata from JSON.  Files are written into
``DIR.tmp`` and the directory is renamed into place only when complete.  A crash mid-save leaves
the previous checkpoint in ``DIR`` (or, between the two renames, in ``DIR.old``, which loading
falls back to).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from mobius.errors import InputError

FORMAT = "mobius-checkpoint-1"
MANIFEST = "manifest.json"


class CheckpointError(InputError):
    """A checkpoint that cannot be used: the message names the file and the problem."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def staging_dir(directory: str | os.PathLike) -> Path:
    d = Path(directory).resolve()
    return d.with_name(d.name + ".tmp")


def begin_save(directory: str | os.PathLike) -> Path:
    tmp = staging_dir(directory)
    if tmp.exists():
        shutil.rmtree(tmp)  # the leftovers of a save that crashed
    tmp.mkdir(parents=True)
    return tmp


def write_tensors(staging: Path, filename: str, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    if tensors:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(staging / filename))


def finish_save(directory: str | os.PathLike, staging: Path, meta: dict) -> None:
    """Checksum every file, write the manifest, fsync, and swap the directory into place."""
    files = {f.name: sha256(f) for f in sorted(staging.iterdir()) if f.is_file()}
    manifest = {"format": FORMAT, **meta, "files": files}
    path = staging / MANIFEST
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for name in files:
        with open(staging / name, "rb") as f:
            os.fsync(f.fileno())
    final = Path(directory).resolve()
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    if old.exists():
        shutil.rmtree(old)


@dataclass
class Checkpoint:
    directory: Path
    manifest: dict
    _index: dict[str, Path]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def names(self) -> set[str]:
        return set(self._index)

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self._index:
            raise CheckpointError(f"checkpoint {self.directory}: tensor {name!r} is missing")
        with safe_open(str(self._index[name]), framework="pt") as h:
            return h.get_tensor(name)


def load_checkpoint(directory: str | os.PathLike, verify: bool = True) -> Checkpoint:
    """Open and verify a checkpoint; any problem is a :class:`CheckpointError` naming the file."""
    d = Path(directory)
    if not (d / MANIFEST).is_file():
        old = d.resolve().with_name(d.resolve().name + ".old")
        if (old / MANIFEST).is_file():
            d = old  # a crash between the two renames of a save
        elif d.is_dir() or d.exists():
            raise CheckpointError(f"--resume {directory}: {d / MANIFEST} is missing: not a complete checkpoint")
        else:
            raise CheckpointError(f"--resume {directory}: no such checkpoint directory")
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"--resume {directory}: {d / MANIFEST} is unreadable or truncated ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "files" not in manifest:
        raise CheckpointError(f"--resume {directory}: {d / MANIFEST} is not a {FORMAT} manifest")
    for key in ("step", "model_config", "seed"):
        if key not in manifest:
            raise CheckpointError(f"--resume {directory}: {d / MANIFEST} lacks {key!r}")
    index: dict[str, Path] = {}
    from safetensors import safe_open

    for name, digest in manifest["files"].items():
        path = d / name
        if not path.is_file():
            raise CheckpointError(f"--resume {directory}: {path} is missing")
        if verify and sha256(path) != digest:
            raise CheckpointError(f"--resume {directory}: {path} is corrupt (checksum mismatch)")
        if name.endswith(".safetensors"):
            try:
                with safe_open(str(path), framework="pt") as h:
                    for key in h.keys():
                        index[key] = path
            except Exception as err:  # safetensors raises its own error types
                raise CheckpointError(f"--resume {directory}: {path} is not a safetensors file ({err})") from None
    return Checkpoint(d, manifest, index)


def check_compatible(ckpt: Checkpoint, model_config: dict, cfg) -> None:
    """The checkpoint must be of this model and this run's data and batch shape."""
    theirs = ckpt.manifest["model_config"]
    mine = {k: v for k, v in model_config.items() if k != "checkpoint"}
    theirs = {k: v for k, v in theirs.items() if k != "checkpoint"}
    if theirs != mine:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        raise CheckpointError(f"--resume {ckpt.directory}: checkpoint is of a different model (differs in {', '.join(diff)})")
    for key in ("seed", "micro_batch_size", "micro_batches", "seq_len", "data"):
        if key in ckpt.manifest and ckpt.manifest[key] != getattr(cfg, key):
            raise CheckpointError(f"--resume {ckpt.directory}: checkpoint was taken with --{key.replace('_', '-')} "
                                  f"{ckpt.manifest[key]!r}, this run has {getattr(cfg, key)!r}")
    if ckpt.step > cfg.steps:
        raise CheckpointError(f"--resume {ckpt.directory}: checkpoint is at step {ckpt.step}, beyond --steps {cfg.steps}")


def run_meta(cfg, model_config: dict, step: int, scaler) -> dict:
    return {"step": step, "total_steps": cfg.steps, "model": cfg.model, "model_config": model_config,
            "seed": cfg.seed, "micro_batch_size": cfg.micro_batch_size, "micro_batches": cfg.micro_batches,
            "seq_len": cfg.seq_len, "data": cfg.data, "precision": cfg.precision, "backend": cfg.backend,
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
    """Weights and AdamW state for ``named_params``; ``aliases`` maps a tied copy to the stored name."""
    aliases = aliases or {}
    with torch.no_grad():
        for name, p in named_params.items():
            stored = aliases.get(name, name)
            value = ckpt.get(stored)
            if value.shape != p.shape:
                raise CheckpointError(f"--resume {ckpt.directory}: {stored} has shape {tuple(value.shape)}, "
                                      f"the model has {tuple(p.shape)}")
            p.copy_(value)
            if f"exp_avg/{stored}" in ckpt.names():
                optimizer.state[p] = {"step": ckpt.get(f"step/{stored}").clone(),
                                      "exp_avg": ckpt.get(f"exp_avg/{stored}").clone(),
                                      "exp_avg_sq": ckpt.get(f"exp_avg_sq/{stored}").clone()}


def rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["rng/torch_cuda"] = torch.cuda.get_rng_state()
    return out


def restore_rng(ckpt: Checkpoint) -> None:
    if "rng/torch_cpu" in ckpt.names():
        torch.set_rng_state(ckpt.get("rng/torch_cpu"))
    if torch.cuda.is_available() and "rng/torch_cuda" in ckpt.names():
        torch.cuda.set_rng_state(ckpt.get("rng/torch_cuda"))


def restore_scaler(ckpt: Checkpoint, scaler) -> None:
    scaler.scale = float(ckpt.manifest.get("loss_scale", scaler.scale))
    scaler.clean_steps = int(ckpt.manifest.get("loss_scale_clean_steps", 0))
    scaler.skipped_steps = int(ckpt.manifest.get("skipped_steps", 0))
