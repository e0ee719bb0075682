import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))  # make_tiny_chat_model

import os  # noqa: E402

# Every run in the tests goes through the stream-order checker of the CPU device layer
# (mobius.runtime.device), pipeline workers included (they inherit the environment).
os.environ.setdefault("MOBIUS_CHECK_STREAMS", "1")


def save_hf_model(model, directory) -> str:
    """A ``transformers`` model saved as a Hugging Face directory with a byte-level tokenizer
    (ids 0-255 are the bytes): what a user's model directory holds."""
    from make_tiny_chat_model import byte_tokenizer

    model.save_pretrained(str(directory))
    byte_tokenizer().save(str(Path(directory) / "tokenizer.json"))
    return str(directory)
