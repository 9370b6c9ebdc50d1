"""The common case in a few lines: :func:`serve` a model's trunk, :func:`connect` to it and generate.

::

    import splitfed
    server = splitfed.serve("HuggingFaceTB/SmolLM2-135M", port=50051)
    lm = splitfed.connect("127.0.0.1:50051", "HuggingFaceTB/SmolLM2-135M")
    print(lm.generate("The capital of France is", max_new_tokens=8))

The server reads only the trunk's weights; the client reads only the bottom's
and the top's (and the tokenizer) from its own copy of the model, and the trunk's
KV cache lives in a session on the server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from splitfed.errors import ConfigError
from splitfed.serving.spec import ModelSpec

if TYPE_CHECKING:  # the channel is only a type here
    from splitfed.channel.client.trunk import TrunkClient
    from splitfed.channel.server.trunkserver import TrunkServer


def serve(model: str | ModelSpec, port: int = 50051, *, host: str = "127.0.0.1", credentials: Any = None,
          admin_token: str | None = None, metrics_port: int | None = None, **spec: Any) -> TrunkServer:
    """Start a trunk server for ``model`` (a named model, a local folder or a hub id) and return it once the model
    is READY.

    ``spec`` takes the :class:`ModelSpec` fields (``cuts``, ``lora_rank``, ``device``, ``trunk_mode``, ``lr``,
    ...; default cuts: the named model's, else the first and last blocks on the client). Plaintext on a loopback
    ``host``; elsewhere give ``credentials`` (``grpc.ServerCredentials``). More models can be loaded later
    (:meth:`TrunkServer.load`, or ``splitfed models load`` with ``admin_token``).
    """
    from splitfed.channel.security.hosts import is_loopback
    from splitfed.channel.server.trunkserver import TrunkServer

    if isinstance(model, ModelSpec):
        if spec:
            raise ConfigError("give a ModelSpec or a model with keyword settings, not both")
        model_spec = model
    else:
        model_spec = ModelSpec(model, **spec)
    insecure = credentials is None and is_loopback(host)
    return TrunkServer(host=host, port=port, insecure=insecure, credentials=credentials, models=[model_spec],
                       admin_token=admin_token, metrics_port=metrics_port).start()


class RemoteLM:
    """A causal language model whose trunk is on a trunk server: tokenizer, bottom and top in this process.

    Args:
        client: a connected :class:`~splitfed.channel.client.trunk.TrunkClient` (its ``model`` names the served model).
        source: where this process reads the bottom, the top and the tokenizer (default: the served model's name).
    """

    def __init__(self, client: TrunkClient, source: str | None = None) -> None:
        from splitfed.models import llm
        from splitfed.models.partload import load_parts

        info = client.info()
        self.client = client
        self.source = source or info.model
        if not self.source:
            raise ConfigError("the server does not name its model: give source= (a named model, folder or hub id)")
        self.cuts = (int(info.cuts[0]), int(info.cuts[1])) if len(info.cuts) == 2 else None
        parts = load_parts(self.source, self.cuts, ("bottom", "top"))
        self.bottom, self.top = parts.bottom.eval(), parts.top.eval()
        self.tokenizer = llm.load_tokenizer(self.source)
        config = llm.load_config(self.source)
        eos = {t for t in (self.tokenizer.eos_token_id,) if t is not None}
        config_eos = getattr(config, "eos_token_id", None)
        eos |= set(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
        self.eos_token_ids = sorted(eos)

    def generate_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                     max_new_tokens: int = 32, **sampling: Any) -> torch.Tensor:
        """Token ids in, prompt + new token ids out (see :func:`splitfed.client.generation.generate`)."""
        from splitfed.client.generation import RemoteSession, generate

        with torch.no_grad(), RemoteSession(self.client, input_ids.shape[1] + max_new_tokens,
                                            batch_size=input_ids.shape[0]) as session:
            return generate(self.bottom, session, self.top, input_ids, attention_mask,
                            max_new_tokens=max_new_tokens, eos_token_id=self.eos_token_ids,
                            pad_token_id=self.tokenizer.pad_token_id, **sampling)

    def generate(self, prompt: str, max_new_tokens: int = 32, *, chat: bool = False, **sampling: Any) -> str:
        """The text generated after ``prompt`` (greedy by default; ``temperature``, ``top_k``, ``top_p``,
        ``seed`` sample). ``chat`` wraps the prompt in the tokenizer's chat template."""
        if chat:
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                        add_generation_prompt=True)
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        out = self.generate_ids(ids, max_new_tokens=max_new_tokens, **sampling)
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

    def close(self) -> None:
        """Close the connection."""
        self.client.close()

    def __enter__(self) -> RemoteLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(address: str, model: str = "", *, source: str | None = None, credentials: Any = None,
            token: str | None = None) -> RemoteLM:
    """A :class:`RemoteLM` over the trunk server at ``address`` serving ``model`` (empty: its only model).

    Plaintext to a loopback address; elsewhere give ``credentials`` (``grpc.ChannelCredentials``).
    """
    from splitfed.channel.client.trunk import TrunkClient
    from splitfed.channel.security.hosts import host_of, is_loopback

    insecure = credentials is None and is_loopback(host_of(address))
    client = TrunkClient(address, insecure=insecure, credentials=credentials, token=token, model=model)
    try:
        return RemoteLM(client, source=source or model or None)
    except BaseException:
        client.close()
        raise
