"""A tiny, randomly initialised Llama folder for trying the LLM commands offline.

``python -m splitfed.models.tiny_llama ./tiny-llama`` writes a 4-block Llama (hidden size 32, untrained: its text is
noise) with ``save_pretrained`` and a byte-level tokenizer that needs no download, with a chat template, so
``splitfed serve --model ./tiny-llama``, ``splitfed generate`` and ``splitfed chat`` run on any machine.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

#: 256 bytes, then the special tokens.
SPECIALS = ("<bos>", "<eos>", "<pad>")
VOCAB = 256 + len(SPECIALS)
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def save_byte_tokenizer(folder: Path) -> None:
    """Save a fast byte-level tokenizer (BPE without merges: one token per byte) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for i, special in enumerate(SPECIALS):
        vocab[special] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def make_tiny_llama(folder: str | Path, layers: int = 4, seed: int = 0) -> Path:
    """Write a tiny untrained Llama of ``layers`` blocks and its tokenizer to ``folder`` (created) and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if layers < 3:
        raise ValueError(f"layers={layers}: a split model needs at least 3 blocks (bottom, trunk, top)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                         bos_token_id=256, eos_token_id=257, pad_token_id=258)
    LlamaForCausalLM(config).save_pretrained(folder)
    save_byte_tokenizer(folder)
    log.info("wrote a %d-block tiny Llama to %s", layers, folder)
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m splitfed.models.tiny_llama FOLDER [--layers N] [--seed S]``."""
    parser = argparse.ArgumentParser(prog="python -m splitfed.models.tiny_llama",
                                     description="Write a tiny untrained Llama and a byte tokenizer to FOLDER.")
    parser.add_argument("folder", help="where to write it (created)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    make_tiny_llama(args.folder, args.layers, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
