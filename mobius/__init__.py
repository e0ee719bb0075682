"""Mobius: fine-tune language models larger than GPU memory on commodity PCIe GPU servers.

The model is an ordered list of layers (``mobius.models``); the partitioner (``mobius.partition``)
cuts it into stages, cross mapping (``mobius.mapping``) places the stages on GPUs, and the
pipeline runtime (``mobius.stages`` + ``mobius.swap``) trains it with stage swapping.
"""

__version__ = "0.1.0"
