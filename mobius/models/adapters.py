"""LoRA adapters out, in the ecosystem's formats.

* ``--export DIR`` under LoRA: a PEFT adapter directory, ``adapter_config.json`` +
  ``adapter_model.safetensors`` with PEFT's tensor names
  (``base_model.model.<module path>.lora_A.weight``), which ``peft.PeftModel.from_pretrained(base,
  DIR)`` loads onto the unchanged base model;
* ``--export-merged DIR``: a full Hugging Face model with every adapter merged into its base weight
  (``W + alpha/r * B A``, as PEFT's ``merge_and_unload``); every other tensor is the input's.

Both are assembled in a staging directory of ours and renamed into place when complete, like
every export (:mod:`mobius.models.hf`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from mobius.boundary import ownership
from mobius.boundary.errors import InputError
from mobius.models.architecture import GPTConfig
from mobius.models.hf import (
    EXPORT_KIND,
    TOKENIZER_FILES,
    _layer_map,
    copy_model_files,
    export_errors,
    finalize_export,
    write_shard,
)
from mobius.models.lora import ADAPTABLE, LORA_MODULES, MOE_TARGETS, adapted_parts, parts

# Where each family's decoder sits inside its ``*ForCausalLM`` module tree (PEFT names modules by it).
# Gemma 3 with its vision tower: the language model is one branch of the tree.
MODULE_ROOT = {"gpt2": "transformer.", "opt": "model.decoder.", "gemma3": "model.language_model."}  # others: "model."
ADAPTER_FILE = "adapter_model.safetensors"
# A mixture's stacked experts, by the name PEFT's target_parameters gives their parameter.
EXPERT_PARAMETERS = {"experts_fc": "gate_up_proj", "experts_out": "down_proj"}


def lora_targets(config: GPTConfig, names: tuple[str, ...]) -> tuple[str, ...]:
    """``--lora-targets`` as the model's targets (:func:`mobius.models.lora.adapted_parts`): our
    projections' names, or, for a Hugging Face model, PEFT's module names of its family (``q_proj``,
    ``v_proj``, ``gate_proj``, GPT-2's ``c_attn``, ...: a name adapts every module whose last path
    component it is, as PEFT matches it; a mixture's router by its module's name, ``gate`` or
    ``router``, its experts by their parameters', ``experts.gate_up_proj`` and ``experts.down_proj``);
    in one order whatever order they were given in."""
    ours = LORA_MODULES + (MOE_TARGETS if config.experts else ())
    peft: dict[str, list[tuple[str, int]]] = {}  # a module's last path component -> (our module, its part)
    if config.hf_arch:
        for module in ours:
            for part, path in enumerate(module_paths(config, first_block_with(config, module), module)):
                name = f"experts.{EXPERT_PARAMETERS[module]}" if module in EXPERT_PARAMETERS else path.rsplit(".", 1)[-1]
                peft.setdefault(name, []).append((module, part))
    chosen: dict[str, set[int]] = {}
    for name in names:
        found = [(name, p) for p in range(len(parts(config, name)))] if name in ours else peft.get(name, [])
        for module, part in found:
            chosen.setdefault(module, set()).add(part)
    if not names or len(set(names)) != len(names) or any(n not in ours and n not in peft for n in names):
        raise InputError(f"--lora-targets {','.join(names)!r}: give distinct names among {', '.join(ours)}"
                         + (f" or {config.hf_arch}'s {', '.join(peft)}" if peft else ""))
    targets: list[str] = []
    for module in (m for m in ADAPTABLE if m in chosen and first_block_with(config, m)):
        every = len(chosen[module]) == len(parts(config, module))
        targets += [module] if every else [f"{module}.{part}" for part in sorted(chosen[module])]
    return tuple(targets)


def module_paths(config: GPTConfig, index: int | None, module: str) -> list[str]:
    """The Hugging Face module paths of our projection ``module`` in layer ``index`` (one per part;
    none where the layer has no such projection: a mixture of experts' block has no ``fc``)."""
    root = MODULE_ROOT.get(config.hf_arch, "model.")
    if module in MOE_TARGETS:  # named as transformers' model holds them (a checkpoint may store them otherwise)
        if index is None:
            return []
        mlp = f"{root}layers.{index - 1}.mlp."
        return [mlp + ("experts" if module in EXPERT_PARAMETERS else "router" if config.hf_arch == "gpt_oss" else "gate")]
    piece = next((p for p in _layer_map(config, index, root) if p.ours == f"{module}.weight"), None) \
        if index is not None else None
    return [] if piece is None else [name.removesuffix(".weight") for name in piece.names]


def blocks_with(config: GPTConfig, module: str) -> list[int]:
    """The blocks (layer indices) that have our projection ``module``: every one, but for the MLP's,
    those that are not mixtures of experts; a router's and experts', those that are."""
    if module in ("fc", "fc_out"):
        return [j + 1 for j in range(config.n_layer) if not config.is_moe(j)]
    if module in MOE_TARGETS:
        return [j + 1 for j in range(config.n_layer) if config.is_moe(j)]
    return [j + 1 for j in range(config.n_layer)]


def first_block_with(config: GPTConfig, module: str) -> int | None:
    """The first block (a layer index) that has our projection ``module``, None where none has (the
    MLP's of a model whose every block is a mixture of experts)."""
    return next(iter(blocks_with(config, module)), None)


def adapter_tensors(config: GPTConfig, layers: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors (fp32) from {layer index: local-name state}."""
    out = {}
    adapted = adapted_parts(config)
    for index, state in layers.items():
        for module, chosen in adapted.items():
            if module in EXPERT_PARAMETERS:
                if f"{module}_lora.lora_A" in state:
                    out.update(_expert_adapter_tensors(config, index, module, state, adapted))
                continue
            if f"{module}.lora_A.{chosen[0]}" not in state:
                continue
            for part, path in enumerate(module_paths(config, index, module)):
                if part not in chosen:
                    continue
                for ab in ("A", "B"):
                    tensor = state[f"{module}.lora_{ab}.{part}"]
                    out[f"base_model.model.{path}.lora_{ab}.weight"] = tensor.detach().float().contiguous().cpu()
                if config.lora_dora:  # PEFT's name for DoRA's magnitudes
                    tensor = state[f"{module}.lora_magnitude.{part}"]
                    out[f"base_model.model.{path}.lora_magnitude_vector"] = tensor.detach().float().contiguous().cpu()
    return out


def _expert_adapter_tensors(config: GPTConfig, index: int, module: str, state: dict[str, torch.Tensor],
                            adapted: dict) -> dict[str, torch.Tensor]:
    """The experts' A and B of ``module`` in layer ``index`` under PEFT's names: where both stacks
    are adapted, the gate | up wrapper is the inner one (``experts.base_layer.lora_A``), as PEFT
    nests them in the order of the experts' parameters.  GPT-OSS stores gate and up interleaved:
    B's rows go back to that order."""
    inner = module == "experts_fc" and "experts_out" in adapted
    path = module_paths(config, index, module)[0] + (".base_layer" if inner else "")
    a, b = state[f"{module}_lora.lora_A"], state[f"{module}_lora.lora_B"]
    if module == "experts_fc" and config.hf_arch == "gpt_oss":
        width = config.expert_ffn
        b = torch.stack([b[:width], b[width:]], dim=1).reshape(b.shape)  # rows gate 0, up 0, gate 1, ...
    return {f"base_model.model.{path}.lora_{ab}.weight": t.detach().float().contiguous().cpu()
            for ab, t in (("A", a), ("B", b))}


def _merged_experts(config: GPTConfig, module: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The stack ``module`` with each expert's adapter merged: ``W_e + s B_e A_e``."""
    e, r = config.experts, config.lora_rank
    a, b = state[f"{module}_lora.lora_A"].float(), state[f"{module}_lora.lora_B"].float()
    w = state[module].float()
    delta = torch.einsum("ork,kri->koi", b.view(b.shape[0], r, e), a.view(e, r, -1))
    return (w.view(e, b.shape[0], -1) + delta * (config.lora_alpha / r)).reshape(w.shape)


def merged_layers(config: GPTConfig, layers: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    """The layers' weights with every adapter merged into its base weight (in fp32)."""
    scaling = config.lora_alpha / config.lora_rank
    out = {}
    for index, state in layers.items():
        merged = {k: v for k, v in state.items() if ".lora_" not in k and "_lora." not in k}
        for module, chosen in adapted_parts(config).items():
            if module in EXPERT_PARAMETERS:
                if f"{module}_lora.lora_A" in state:
                    merged[module] = _merged_experts(config, module, state)
                continue
            if f"{module}.lora_A.{chosen[0]}" not in state:
                continue
            rows = []  # each part's rows, merged where it has an adapter
            for i, w in enumerate(state[f"{module}.weight"].float().split(parts(config, module))):
                if i in chosen:
                    w = w + state[f"{module}.lora_B.{i}"].float() @ state[f"{module}.lora_A.{i}"].float() * scaling
                    if config.lora_dora:  # each row rescaled to its trained magnitude, as PEFT merges DoRA
                        magnitude = state[f"{module}.lora_magnitude.{i}"].float()
                        w = (magnitude / torch.linalg.norm(w, dim=1)).view(-1, 1) * w
                rows.append(w)
            merged[f"{module}.weight"] = torch.cat(rows, dim=0)
        out[index] = merged
    return out


def adapter_config(config: GPTConfig) -> dict:
    """``adapter_config.json``: what PEFT needs to rebuild the adapters on the base model (a
    mixture's router and experts as ``target_parameters``)."""
    adapted = adapted_parts(config)
    targets = sorted({".".join(path.split(".")[-2:]) for module, chosen in adapted.items() if module in LORA_MODULES
                      for part, path in enumerate(module_paths(config, first_block_with(config, module), module))
                      if part in chosen})
    parameters = sorted(".".join(module_paths(config, first_block_with(config, m), m)[0].split(".")[-2:])
                        + f".{EXPERT_PARAMETERS.get(m, 'weight')}" for m in adapted if m in MOE_TARGETS)
    if config.hf_arch == "gemma3":
        # Its vision tower has modules of the same names: name the language model's alone (PEFT
        # matches a string target as a regular expression over the whole module name).
        root = re.escape(MODULE_ROOT[config.hf_arch])
        targets = rf"{root}layers\.\d+\.({'|'.join(re.escape(t) for t in targets)})"
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": config.checkpoint,
            "r": config.lora_rank, "lora_alpha": config.lora_alpha, "lora_dropout": config.lora_dropout, "bias": "none",
            "target_modules": targets or None, "target_parameters": parameters or None,
            "fan_in_fan_out": config.hf_arch == "gpt2",  # GPT-2's Conv1D
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "use_rslora": False, "use_dora": config.lora_dora}


def write_export_shard(config: GPTConfig, staging: Path, name: str, layers: dict[int, dict[str, torch.Tensor]],
                       merged: bool) -> None:
    """This process's part of an export: the model's Hugging Face tensors, or under LoRA its adapter
    tensors (``merged``: the Hugging Face tensors with the adapters merged)."""
    if not config.lora_rank:
        write_shard(config, staging, name, layers)
        return
    if merged:
        write_shard(config, staging, name, merged_layers(config, layers))
        return
    from safetensors.torch import save_file

    tensors = adapter_tensors(config, layers)
    if tensors:
        with export_errors(staging):
            save_file(tensors, str(staging / f"{name}.adapter.safetensors"), metadata={"format": "pt"})


def adapter_tensor_count(config: GPTConfig) -> int:
    """The tensors of a whole model's adapter export: A and B (and DoRA's magnitude) of each part
    adapted, in each block that has its module."""
    per_part = 3 if config.lora_dora else 2
    return sum(per_part * len(chosen) * len(blocks_with(config, module))
               for module, chosen in adapted_parts(config).items())


def finish_export(config: GPTConfig, staging: Path, out_dir: str, merged: bool) -> None:
    """Complete the export assembled in ``staging`` and rename it into place."""
    if merged or not config.lora_rank:
        finalize_export(config, staging, out_dir)
        return
    from safetensors.torch import load_file, save_file

    with export_errors(out_dir):
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(staging.glob("*.adapter.safetensors")):
            tensors.update(load_file(str(shard)))
            shard.unlink()
        if len(tensors) != (expected := adapter_tensor_count(config)):
            raise RuntimeError(f"the export holds {len(tensors)} adapter tensors, expected {expected}")
        save_file(tensors, str(staging / ADAPTER_FILE), metadata={"format": "pt"})
        (staging / "adapter_config.json").write_text(json.dumps(adapter_config(config), indent=2))
        copy_model_files(config, staging, TOKENIZER_FILES)
        ownership.swap_into_place(staging, out_dir, EXPORT_KIND)


def layer_states(named: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """{"layers.<i>.<local>": tensor} -> {i: {local: tensor}}."""
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in named.items():
        _, index, local = name.split(".", 2)
        layers.setdefault(int(index), {})[local] = t
    return layers

