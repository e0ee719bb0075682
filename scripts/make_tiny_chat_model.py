"""Write a tiny random Llama with a byte-level tokenizer and a ChatML chat template, as a Hugging Face
directory: a model to try instruction fine-tuning on in seconds, on any machine, with no download.

    python scripts/make_tiny_chat_model.py runs/tiny-chat
    python -m mobius.train --model runs/tiny-chat --data examples/arithmetic.jsonl --steps 300

Needs ``transformers`` and ``tokenizers`` (``pip install ".[hf]"``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte value, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def byte_tokenizer(special: list[str] = ()):
    """A ``tokenizers`` tokenizer whose ids 0-255 are the bytes, then ``special`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if special:
        tok.add_special_tokens(list(special))
    return tok


def write_chat_tokenizer(directory: Path) -> None:
    """tokenizer.json, tokenizer_config.json (EOS, pad, the ChatML template)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(SPECIAL_TOKENS), eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(directory))


def make_tiny_chat_model(directory: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    import torch
    import transformers as T

    torch.manual_seed(seed)
    eos = 256  # <|endoftext|>: the first id after the bytes
    config = T.LlamaConfig(vocab_size=256 + len(SPECIAL_TOKENS), hidden_size=hidden, intermediate_size=2 * hidden,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, bos_token_id=None, eos_token_id=eos, pad_token_id=eos,
                           tie_word_embeddings=False)
    model = T.LlamaForCausalLM(config)
    model.generation_config = T.GenerationConfig(eos_token_id=[eos, 256 + SPECIAL_TOKENS.index("<|im_end|>")],
                                                 pad_token_id=eos)
    model.save_pretrained(str(directory))
    write_chat_tokenizer(directory)
    return directory


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    if args.directory.exists() and any(args.directory.iterdir()):
        print(f"error: {args.directory} exists and is not empty", file=sys.stderr)
        raise SystemExit(2)
    make_tiny_chat_model(args.directory, args.hidden, args.layers)
    print(f"wrote a tiny Llama ({args.layers} layers, hidden {args.hidden}) with a chat template to {args.directory}")


if __name__ == "__main__":
    main()
