"""Models as ordered layer lists (see :mod:`mobius.models.gpt`)."""

from mobius.models.config import GPTConfig, layer_count
from mobius.models.gpt import (
    Block,
    Embedding,
    GPTLayer,
    Head,
    LayerList,
    build_layer,
    build_model,
    dtype_bytes,
    tied_parameter_names,
)
from mobius.models.presets import PRESETS, get_config

__all__ = [
    "Block", "Embedding", "GPTConfig", "GPTLayer", "Head", "LayerList", "PRESETS", "build_layer",
    "build_model", "dtype_bytes", "get_config", "layer_count", "tied_parameter_names",
]
