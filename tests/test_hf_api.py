"""A SplitModel is called like a Hugging Face model: HF input names, tokenizer output, ModelOutput, Trainer."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import pytest
import torch
from conftest import batch_for, tiny_cnn, tiny_config, tiny_model
from llm_fixtures import VOCAB as BYTE_VOCAB
from llm_fixtures import save_byte_tokenizer
from transformers.modeling_outputs import (
    CausalLMOutput,
    ImageClassifierOutputWithNoAttention,
    SequenceClassifierOutput,
)

from splitfed.channel.client.remote import RemoteTrunk
from splitfed.errors import SplitError
from splitfed.split import SplitModel, split_model

TEXTS = ["the trunk stays on the server", "bottom and top stay home", "gradients come back"]
PAIRS = (["is the trunk remote", "who keeps the head", "where do labels live"],
         ["the server keeps the trunk", "the client keeps the head and the labels", "on the client"])
WORDS = sorted({w for text in TEXTS + PAIRS[0] + PAIRS[1] for w in text.split()})


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest on one thread


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """A real fast byte-level tokenizer (no download), padding on the left as decoders want."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("byte-tokenizer")
    save_byte_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="module")
def bert_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """A real WordPiece BERT tokenizer over this file's words; sentence pairs get token type ids."""
    from transformers import BertTokenizerFast

    folder: Path = tmp_path_factory.mktemp("bert-tokenizer")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS) + "\n")
    return BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))


def _decoder(arch: str, vocab: int = BYTE_VOCAB, seed: int = 0) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    cfg.vocab_size = vocab
    return tf.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mistral"])
def test_tokenizer_output_unpacks_into_the_split_model(arch: str, byte_tokenizer) -> None:
    # Prepare
    model = _decoder(arch)
    ref = copy.deepcopy(model)
    split = split_model(model, cuts=(1, 3))
    enc = byte_tokenizer(TEXTS, return_tensors="pt", padding=True)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    # Execute
    with torch.no_grad():
        want = ref(**enc, labels=labels)
        got = split(**enc, labels=labels)
    # Assert: a CausalLMOutput, read by attribute, key and index, equal to the unsplit model's
    assert isinstance(got, CausalLMOutput)
    assert got.loss is got["loss"] is got[0]
    assert got.logits is got["logits"] is got[1]
    valid = enc["attention_mask"].bool()
    assert (want.logits - got.logits)[valid].abs().max().item() <= 1e-5
    assert abs(want.loss.item() - got.loss.item()) <= 1e-6


def test_keyword_inputs_match_positional_ones() -> None:
    model = tiny_model("qwen2")
    split = split_model(model, cuts=(1, 3))
    ids, mask, labels = batch_for("qwen2", padded=True)
    with torch.no_grad():
        by_name = split(input_ids=ids, attention_mask=mask, labels=labels)
        by_position = split(ids, mask, labels)
    assert torch.equal(by_name.logits, by_position.logits) and torch.equal(by_name.loss, by_position.loss)
    no_labels = split(input_ids=ids, attention_mask=mask)
    assert no_labels.loss is None and no_labels[0] is no_labels.logits and "loss" not in no_labels


def test_explicit_position_ids_are_used() -> None:
    # Prepare: left padding with the positions generate() uses (GPT-2: absolute positions change the output)
    model = tiny_model("gpt2")
    ref = copy.deepcopy(model)
    split = split_model(model, cuts=(1, 3))
    ids, mask, _ = batch_for("gpt2", padded=True)
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    # Execute
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = split(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        default = split(input_ids=ids, attention_mask=mask).logits
    # Assert
    assert (want - got)[mask.bool()].abs().max().item() <= 1e-6
    assert (default - got)[mask.bool()].abs().max().item() > 1e-3


@pytest.mark.parametrize("padded", [False, True])
def test_bert_sentence_pairs_split_exactly(bert_tokenizer, padded: bool) -> None:
    # Prepare: token type ids mark the second sentence; they only matter in the bottom
    import transformers as tf

    torch.manual_seed(0)
    cfg = tiny_config("bert")
    model = tf.BertForSequenceClassification(cfg).eval()
    ref = copy.deepcopy(model)
    split = split_model(model, cuts=(1, 3))
    texts = PAIRS if padded else ([PAIRS[0][0]] * 2, [PAIRS[1][0]] * 2)
    enc = bert_tokenizer(*texts, return_tensors="pt", padding=True)
    assert enc["token_type_ids"].any() and (not padded or not enc["attention_mask"].all())
    labels = torch.tensor([0, 2, 1][: enc["input_ids"].shape[0]])
    # Execute
    with torch.no_grad():
        want = ref(**enc, labels=labels)
        got = split(**enc, labels=labels)
        untyped = split(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    # Assert
    assert isinstance(got, SequenceClassifierOutput)
    assert (want.logits - got.logits).abs().max().item() <= 1e-5
    assert abs(want.loss.item() - got.loss.item()) <= 1e-6
    assert (untyped.logits - got.logits).abs().max().item() > 1e-4  # the token types were used


def test_bert_sentence_pairs_train_exactly(bert_tokenizer) -> None:
    # Prepare
    import transformers as tf

    torch.manual_seed(0)
    model = tf.BertForSequenceClassification(tiny_config("bert")).train()
    ref = copy.deepcopy(model)
    split = split_model(model, cuts=(1, 3))
    enc = dict(bert_tokenizer(*PAIRS, return_tensors="pt", padding=True), labels=torch.tensor([0, 2, 1]))
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, ref)]
    # Execute
    for _ in range(5):
        for net, opt in zip((split, ref), opts):
            net(**enc).loss.backward()
            opt.step()
            opt.zero_grad()
    # Assert: the token type embeddings trained, exactly as in the unsplit model
    key = "bert.embeddings.token_type_embeddings.weight"
    assert not torch.equal(model.state_dict()[key], tf.BertForSequenceClassification(tiny_config("bert")).state_dict()[key])
    for name, p in model.state_dict().items():
        assert torch.allclose(p, ref.state_dict()[name], atol=1e-6), name


def test_gpt2_token_type_ids_split_exactly() -> None:
    model = tiny_model("gpt2")
    ref = copy.deepcopy(model)
    split = split_model(model, cuts=(1, 3))
    ids, mask, _ = batch_for("gpt2")
    types = torch.zeros_like(ids)
    types[:, 6:] = 5
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        got = split(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    assert (want - got).abs().max().item() <= 1e-6


def test_llama_family_ignores_token_type_ids_as_its_forward_does() -> None:
    # Some tokenizers return token_type_ids for decoders; LlamaForCausalLM accepts and ignores them.
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    split = split_model(model, cuts=(1, 3))
    ids, mask, _ = batch_for("llama")
    types = torch.ones_like(ids)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        got = split(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
        plain = split(input_ids=ids, attention_mask=mask).logits
    assert (want - got).abs().max().item() <= 1e-6 and torch.equal(got, plain)


def test_bert_explicit_position_ids_are_used() -> None:
    model = tiny_model("bert")
    ref = copy.deepcopy(model)
    split = split_model(model, cuts=(1, 3))
    ids, mask, _ = batch_for("bert")
    pos = torch.arange(ids.shape[1]).flip(0).expand_as(ids)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = split(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        default = split(input_ids=ids, attention_mask=mask).logits
    assert (want - got).abs().max().item() <= 1e-6
    assert (default - got).abs().max().item() > 1e-4


def test_image_models_take_a_positional_tensor_or_pixel_values() -> None:
    model = tiny_cnn()
    ref = copy.deepcopy(model)
    split = split_model(model, cuts=(3, 6))
    x, y = torch.randn(4, 1, 28, 28), torch.tensor([1, 0, 3, 9])
    with torch.no_grad():
        positional = split(x, labels=y)
        named = split(pixel_values=x, labels=y)
        want = ref(x)
    assert isinstance(positional, ImageClassifierOutputWithNoAttention)
    assert torch.equal(positional.logits, named.logits) and torch.equal(positional.loss, named["loss"])
    assert (positional.logits - want).abs().max().item() <= 1e-6
    with pytest.raises(SplitError, match="exactly one"):
        split(x, pixel_values=x)
    with pytest.raises(SplitError, match="exactly one"):
        split(labels=y)


def test_forward_signature_names_the_hf_inputs() -> None:
    params = inspect.signature(SplitModel.forward).parameters
    assert list(params)[1:] == ["input_ids", "attention_mask", "labels", "position_ids", "token_type_ids",
                                "pixel_values"]


def test_trainer_trains_a_split_model_over_the_real_channel(trunk_server, byte_tokenizer, tmp_path: Path) -> None:
    # Prepare: the trunk on a TrunkServer on loopback, bottom and top in a SplitModel with a RemoteTrunk
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = _decoder("llama").train()
    ref = copy.deepcopy(model)
    split = split_model(model, cuts=(1, 3))
    server = trunk_server(split.trunk, optimizer="adamw", lr=0.01)
    remote = RemoteTrunk(server.address, insecure=True)
    client = SplitModel(split.bottom, remote, split.top, task="causal-lm", config=split.config)
    before = {k: v.clone() for k, v in client.client_modules().state_dict().items()}
    start_version = server.runtime.version
    enc = byte_tokenizer(TEXTS * 2, padding="max_length", max_length=32, truncation=True)
    labels = [[t if m else -100 for t, m in zip(ids, mask)] for ids, mask in zip(enc["input_ids"],
                                                                                 enc["attention_mask"])]
    # "text" is not a forward argument: Trainer must drop it after reading forward's signature.
    data = Dataset.from_dict({"text": TEXTS * 2, "input_ids": enc["input_ids"],
                              "attention_mask": enc["attention_mask"], "labels": labels})

    def args(run: str) -> TrainingArguments:
        # The trunk server's optimizer is a plain AdamW at a constant rate; clipping would see only the
        # client's gradients on the split side, so it is off for the comparison.
        return TrainingArguments(output_dir=str(tmp_path / run), max_steps=3, per_device_train_batch_size=2,
                                 learning_rate=0.01, optim="adamw_torch", lr_scheduler_type="constant",
                                 weight_decay=0.0, max_grad_norm=0.0, report_to=[], save_strategy="no",
                                 use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=7)

    # Execute
    try:
        trainer = Trainer(model=client, args=args("split"), train_dataset=data, eval_dataset=data)
        result = trainer.train()
        metrics = trainer.evaluate()  # eval-mode forwards: the trunk answers without keeping them
    finally:
        remote.close()
    ref_trainer = Trainer(model=ref, args=args("unsplit"), train_dataset=data, eval_dataset=data)
    ref_trainer.train()
    ref_metrics = ref_trainer.evaluate()
    # Assert: three trunk updates, client weights moved, and every weight equals Trainer's on the unsplit model
    assert server.runtime.version == start_version + 3
    assert remote.outcomes == {"APPLIED": 3}
    assert abs(metrics["eval_loss"] - ref_metrics["eval_loss"]) <= 1e-5
    after = client.client_modules().state_dict()
    assert all(not torch.equal(after[k], before[k]) for k in before if k.endswith("weight"))
    assert result.global_step == 3
    want = ref.state_dict()
    for name, value in model.state_dict().items():
        assert torch.allclose(value, want[name], atol=1e-6), name
