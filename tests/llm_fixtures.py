"""Tiny pretrained-style checkpoints written to temp folders: a model plus a byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

from conftest import tiny_config

VOCAB = 259  # 256 bytes + bos/eos/pad


def save_byte_tokenizer(folder: Path) -> None:
    """A real fast tokenizer (byte-level BPE without merges) that needs no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for i, special in enumerate(["<bos>", "<eos>", "<pad>"]):
        vocab[special] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(folder)


def save_tiny(arch: str, folder: Path, layers: int = 4, seed: int = 0, **save_kwargs: object) -> Path:
    """Save a tiny ``arch`` model (vocab 259) and the byte tokenizer to ``folder``."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tiny_config(arch, layers)
    cfg.vocab_size = VOCAB
    if arch != "bert":
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 256, 257, 258
    model = tf.BertForSequenceClassification(cfg) if arch == "bert" else tf.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder, **save_kwargs)
    save_byte_tokenizer(folder)
    return folder
