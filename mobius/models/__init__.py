"""Models as ordered layer lists (see :mod:`mobius.models.gpt`)."""

from mobius.models.architecture import GPTConfig, layer_count
from mobius.models.gpt import (
    Block,
    Embedding,
    GPTLayer,
    Head,
    LayerList,
    build_layer,
    build_model,
    built_layers,
    run_layers,
    tied_parameter_names,
)
from mobius.models.layout import IGNORE, TokenLayout
from mobius.models.presets import PRESETS, get_config

__all__ = [
    "Block", "Embedding", "GPTConfig", "GPTLayer", "Head", "IGNORE", "LayerList", "PRESETS", "TokenLayout",
    "build_layer", "build_model", "built_layers", "get_config", "layer_count", "run_layers", "tied_parameter_names",
]
