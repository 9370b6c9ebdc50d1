"""What crosses a cut, the three parts' common interface, and the local three-part model."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import (
    CausalLMOutput,
    ImageClassifierOutputWithNoAttention,
    SequenceClassifierOutput,
)

from splitfed.errors import SplitError

Role = Literal["bottom", "trunk", "top"]
Task = Literal["causal-lm", "classification"]

#: Names of the tensors a :class:`CutState` carries on the wire.
CUT_FIELDS = ("hidden", "attention_mask", "position_ids")


@dataclass
class CutState:
    """What crosses a cut: the hidden state plus what the next part needs.

    ``attention_mask`` is the 2-D padding mask (1 = token, 0 = padding) over the
    whole sequence seen so far (past tokens of a KV cache included);
    ``position_ids`` are the positions of the tokens in ``hidden``, ``None``
    for the default ones (``past + arange``, which each part makes again from
    its own KV cache; only explicit positions travel). Both are ``None`` for
    models that do not use them (the CNN). Each part rebuilds its
    own 4-D mask and rotary embeddings from these. ``blocks`` asks a trunk to
    run only model blocks ``[start, end)`` of its own (a client with a
    heterogeneous cut, see :func:`requested_blocks`); ``None`` runs them all.
    It is not a tensor and never travels as one.
    """

    hidden: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    blocks: tuple[int, int] | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The non-empty fields by name, in :data:`CUT_FIELDS` order."""
        out = {"hidden": self.hidden}
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            out["position_ids"] = self.position_ids
        return out

    def with_hidden(self, hidden: torch.Tensor) -> CutState:
        """The same state around a new hidden tensor."""
        return replace(self, hidden=hidden)


@dataclass(frozen=True)
class PartSpec:
    """How a part's parameters are named in the full (unsplit) model's state dict.

    ``prefixes`` maps a prefix of the part's own state-dict keys to the prefix
    the same tensors have in the full model, e.g. ``("layers.0.", "model.layers.4.")``.
    """

    role: Role
    arch: str
    first_layer: int
    num_layers: int
    prefixes: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def full_key(self, part_key: str) -> str:
        """The full model's key for one of this part's state-dict keys."""
        for mine, theirs in self.prefixes:
            if part_key.startswith(mine):
                return theirs + part_key[len(mine):]
        raise KeyError(f"{self.role} key {part_key!r} has no counterpart in the full model")

    def part_key(self, full_key: str) -> str | None:
        """This part's key for a full-model key, or None when the part does not own it."""
        for mine, theirs in self.prefixes:
            if full_key.startswith(theirs):
                return mine + full_key[len(theirs):]
        return None


class Part(nn.Module):
    """Base of every part: carries its :class:`PartSpec`."""

    spec: PartSpec

    @property
    def role(self) -> Role:
        """``bottom``, ``trunk`` or ``top``."""
        return self.spec.role

    def block_slice(self, state: CutState) -> slice:
        """Which of this part's own blocks to run for ``state``: all of them, or ``state.blocks`` (model block
        indices) translated to this part's numbering. Raises :class:`SplitError` for a range it does not hold."""
        if state.blocks is None:
            return slice(0, self.spec.num_layers)
        first = self.spec.first_layer
        start, end = requested_blocks(*state.blocks, (first, first + self.spec.num_layers))
        return slice(start - first, end - first)


def requested_blocks(cut_start: int, cut_end: int, trunk_range: tuple[int, int]) -> tuple[int, int]:
    """Check a client's cut ``(cut_start, cut_end)`` against a trunk holding blocks ``trunk_range``.

    Returns the model blocks the trunk runs for that client, ``[cut_start, cut_end)``; ``(0, 0)`` stands
    for the trunk's whole range. Raises :class:`SplitError` when ``cut_start > cut_end`` or the range is not
    inside the trunk's.
    """
    lo, hi = int(trunk_range[0]), int(trunk_range[1])
    if cut_start == 0 and cut_end == 0:
        return lo, hi
    if cut_start > cut_end:
        raise SplitError(f"cut_start {cut_start} > cut_end {cut_end}: the trunk runs blocks [cut_start, cut_end) "
                         "for a client whose bottom ends at cut_start and whose top starts at cut_end; send them "
                         "in that order")
    if cut_start < lo or cut_end > hi:
        raise SplitError(f"the client is cut at ({cut_start}, {cut_end}), outside this trunk's blocks [{lo}, {hi}) "
                         f"(a trunk served at cuts {lo},{hi}): split the client's model at cuts=({lo}, {hi}) (or at "
                         f"cuts (a, b) with {lo} <= a <= b <= {hi}), or serve a trunk that holds blocks "
                         f"[{cut_start}, {cut_end}) (with heterogeneous cuts: client-cuts that include this cut)")
    return int(cut_start), int(cut_end)


def check_cuts(cuts: tuple[int, int] | list[int], num_layers: int) -> tuple[int, int]:
    """Validate ``(a, b)`` against ``num_layers``: ``0 <= a < b <= num_layers``."""
    if len(cuts) != 2:
        raise SplitError(f"cuts must be two layer indices (a, b), got {cuts!r}")
    a, b = int(cuts[0]), int(cuts[1])
    if not 0 <= a < b <= num_layers:
        raise SplitError(f"cuts {(a, b)} do not fit a model of {num_layers} blocks: need "
                         f"0 <= a < b <= {num_layers} so the trunk holds at least one block")
    return a, b


def reindex_layers(layers: nn.ModuleList) -> None:
    """Number the attention modules of ``layers`` 0..k-1 so a part owns its own KV cache."""
    for i, layer in enumerate(layers):
        for module in layer.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = i


def part_range(module: nn.Module) -> tuple[int, int] | None:
    """The model blocks ``[first, end)`` a part holds, or None for a module without a :class:`PartSpec`."""
    spec = getattr(module, "spec", None)
    return None if spec is None else (spec.first_layer, spec.first_layer + spec.num_layers)


def client_cut(bottom: nn.Module, top: nn.Module) -> tuple[int, int] | None:
    """The cut ``(a, b)`` of a client holding ``bottom`` (blocks ``[0, a)``) and ``top`` (blocks ``[b, n)``), or
    None when the parts do not carry their block ranges."""
    low, high = part_range(bottom), part_range(top)
    return None if low is None or high is None else (low[1], high[0])


def input_mismatch_hint(trunk_range: tuple[int, int] | None) -> str:
    """What to check when a trunk could not run a client's input: most often the client was split at other cuts
    (and did not send them), so its activation has another shape than this trunk's first block takes."""
    if trunk_range is None:
        return ""
    lo, hi = int(trunk_range[0]), int(trunk_range[1])
    return (f"; this trunk holds blocks [{lo}, {hi}) (cuts {lo},{hi}): a client split at other cuts sends activations "
            f"of another shape, so split the client's model at cuts=({lo}, {hi})")


def with_client_cut(state: CutState, cut_start: int, cut_end: int, trunk_range: tuple[int, int] | None, *,
                    session: bool = False) -> CutState:
    """``state`` with the blocks a client's cut asks the trunk to run (see :func:`requested_blocks`).

    ``(0, 0)`` and the trunk's whole range leave ``state`` as it is. Raises :class:`SplitError` for a cut the
    trunk cannot serve, for a trunk of unknown range, and for a sub-range in an inference ``session``.
    """
    if not (cut_start or cut_end):
        return state
    if trunk_range is None:
        raise SplitError("this trunk does not know its block range, so it cannot serve a client's own cut; "
                         "send cut_start = cut_end = 0")
    blocks = requested_blocks(cut_start, cut_end, trunk_range)
    if blocks == tuple(trunk_range):
        return state
    if session:
        raise SplitError(f"inference sessions run the trunk's whole range {tuple(trunk_range)}, not blocks "
                         f"{blocks}; generate with the run's shared cuts")
    return replace(state, blocks=blocks)


#: What :meth:`SplitModel.forward` returns: a Hugging Face ``ModelOutput`` with ``loss`` (None without labels)
#: and ``logits``, readable as ``out.loss``, ``out["loss"]`` and ``out[0]``.
SplitOutput = CausalLMOutput | SequenceClassifierOutput | ImageClassifierOutputWithNoAttention


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, mean over labels that are not -100 (as transformers computes it)."""
    labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device),
                           ignore_index=-100)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, problem_type: str | None = None) -> torch.Tensor:
    """The loss ``*ForSequenceClassification`` computes for ``problem_type``.

    Without a problem type it is inferred as transformers does: one output is
    ``regression`` (mean squared error), integer labels are
    ``single_label_classification`` (cross entropy), anything else is
    ``multi_label_classification`` (binary cross entropy with logits).
    """
    labels = labels.to(logits.device)
    num_labels = logits.shape[-1]
    if problem_type is None:
        if num_labels == 1:
            problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    if problem_type == "regression":
        if num_labels == 1:
            return F.mse_loss(logits.squeeze().float(), labels.squeeze().float())
        return F.mse_loss(logits.float(), labels.float())
    if problem_type == "single_label_classification":
        return F.cross_entropy(logits.float().reshape(-1, num_labels), labels.reshape(-1))
    if problem_type == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
    raise SplitError(f"unknown problem_type {problem_type!r}: use regression, single_label_classification or "
                     "multi_label_classification")


class SplitModel(nn.Module):
    """Bottom, trunk and top run in sequence; the trunk may be local or a :class:`RemoteTrunk`.

    ``forward`` takes what the unsplit Hugging Face model takes, by the same
    names (``input_ids``, ``attention_mask``, ``labels``, ``position_ids``,
    ``token_type_ids``), so ``model(**tokenizer(texts, return_tensors="pt"))``
    and ``transformers.Trainer`` work; image models take their tensor
    positionally or as ``pixel_values``. It returns a Hugging Face
    ``ModelOutput`` (:data:`SplitOutput`). With ``micro_batches = k > 1`` each
    batch runs as k micro-batches, several in flight across the cut (a remote
    trunk overlaps them), with the loss and gradients of the whole batch.
    """

    def __init__(self, bottom: nn.Module, trunk: nn.Module, top: nn.Module, task: Task,
                 config: Any = None, micro_batches: int = 1) -> None:
        super().__init__()
        if int(micro_batches) < 1:
            raise SplitError(f"micro_batches must be >= 1, got {micro_batches}")
        self.bottom = bottom
        self.trunk = trunk
        self.top = top
        cut = client_cut(bottom, top)
        if cut is not None and callable(getattr(trunk, "use_cut", None)):
            trunk.use_cut(cut)  # a remote trunk sends it, so the server refuses a trunk cut elsewhere
        self.task = task
        self.config = config
        #: Micro-batches per batch: more than one pipelines the step across the cut
        #: (see :mod:`splitfed.split.microbatch`); same results as one.
        self.micro_batches = int(micro_batches)

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None) -> SplitOutput:
        """Run the three parts; compute the task's loss when ``labels`` is given.

        Args:
            input_ids: token ids (B, T); for image models, the image batch (also accepted as ``pixel_values``).
            attention_mask: 2-D padding mask, 1 = token, 0 = padding.
            labels: next-token targets (-100 = ignored) for causal LMs, class labels (or targets) otherwise.
            position_ids: explicit positions (B, T), e.g. for left-padded batches.
            token_type_ids: segment ids of sentence pairs (BERT; GPT-2 adds them too; the bottom uses them).
            pixel_values: the image batch, for image models.

        Returns:
            ``CausalLMOutput`` for causal LMs, ``SequenceClassifierOutput`` for token classifiers,
            ``ImageClassifierOutputWithNoAttention`` for image (float) inputs.
        """
        if (input_ids is None) == (pixel_values is None):
            raise SplitError("pass exactly one of input_ids (token ids, or an image batch positionally) and "
                             "pixel_values")
        inputs = input_ids if input_ids is not None else pixel_values
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        parts = min(self.micro_batches, int(inputs.shape[0]))
        if parts > 1:
            from splitfed.split.microbatch import run_micro_batches

            logits = run_micro_batches(self, inputs, parts, {"attention_mask": attention_mask,
                                                             "position_ids": position_ids, **extra})
        else:
            state = self.bottom(inputs, attention_mask=attention_mask, position_ids=position_ids, **extra)
            state = self.trunk(state)
            logits = self.top(state)
        loss = None
        if labels is not None:
            if self.task == "causal-lm":
                loss = causal_lm_loss(logits, labels)
            else:
                loss = classification_loss(logits, labels, getattr(self.config, "problem_type", None))
        if self.task == "causal-lm":
            return CausalLMOutput(loss=loss, logits=logits)
        if inputs.is_floating_point():
            return ImageClassifierOutputWithNoAttention(loss=loss, logits=logits)
        return SequenceClassifierOutput(loss=loss, logits=logits)

    def client_modules(self) -> nn.ModuleDict:
        """Bottom and top together, as the client holds them (tied weights stay tied)."""
        return nn.ModuleDict({"bottom": self.bottom, "top": self.top})


def unique_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (tied ones once) and persistent buffers of ``module``, by state-dict name.

    This is what travels in Flower messages: a tied embedding/head pair is sent
    once, under the first name it appears with.
    """
    state = module.state_dict(keep_vars=True)
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        key = id(tensor)
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach()
    return out


def load_unique_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a :func:`unique_state` dict back; tied duplicates receive the same values."""
    own = module.state_dict(keep_vars=True)
    expected = unique_state(module)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise SplitError(f"state does not match the module: missing {missing[:5]}, unexpected {unexpected[:5]}; "
                         "were both sides built with the same model and cuts?")
    with torch.no_grad():
        for name, value in state.items():
            target = own[name]
            if target.shape != value.shape:
                raise SplitError(f"{name}: shape {tuple(value.shape)} does not match the module's "
                                 f"{tuple(target.shape)}")
            target.copy_(value)
