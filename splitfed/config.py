"""Run configuration: read once from Flower's ``run_config`` (kebab-case keys) into a frozen dataclass.

The library never sees a Flower ``Context``: apps pass ``context.run_config``
(a plain mapping) to :meth:`RunConfig.from_mapping`, which checks every value
and names the offending key in its error.
"""

from __future__ import annotations

import dataclasses
import difflib
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from splitfed.errors import ConfigError

_MODES = ("sync", "async", "quorum", "per-client", "sequential")
_PARTITIONERS = ("iid", "dirichlet", "pathological")
_STRATEGIES = ("fedavg", "fedprox", "fedadam", "fedavgm", "fedadagrad", "fedyogi", "fedmedian", "fedtrimmedavg",
               "krum", "multikrum", "bulyan", "qfedavg")
_DP_WRAPPERS = ("", "server-fixed", "server-adaptive", "client-fixed", "client-adaptive")
_OPTIMIZERS = ("sgd", "adam", "adamw")
_WIRE = ("fp32", "fp16", "bf16")
_PRECISION = ("fp32", "bf16")


def _key(name: str) -> str:
    return name.replace("_", "-")


@dataclass(frozen=True)
class RunConfig:
    """Every setting of a SplitFed run. Field ``foo_bar`` is run-config key ``foo-bar``."""

    # Model and cut.
    model: str = "mnist-cnn"  # named model, local folder or hub id
    cuts: tuple[int, int] | None = None  # None: the named model's default
    max_seq_len: int = 128  # tokens per example for language models
    lora_rank: int = 0  # LoRA adapters on every part (0: full fine-tuning)
    lora_alpha: float = 0.0  # 0: twice the rank
    lora_dropout: float = 0.0
    lora_targets: str = ""  # comma-separated module names; empty: the architecture's projections
    compile: bool = False  # torch.compile every part
    # Rounds and local training.
    num_server_rounds: int = 5
    local_steps: int = 30  # optimizer steps per client per round (0: use local-epochs)
    local_epochs: int = 0
    batch_size: int = 32
    lr: float = 0.05
    trunk_lr: float = 0.0  # 0: same as lr
    optimizer: str = "sgd"
    momentum: float = 0.0
    weight_decay: float = 0.0
    eval_batches: int = 0  # 0: the whole held-out split
    seed: int = 42
    # Federation.
    strategy: str = "fedavg"
    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0
    min_train_nodes: int = 2  # a round with fewer successful train replies fails the run
    accept_failures: float = 0.5  # fraction of a round's sampled clients that may fail before the run fails
    node_wait_timeout: float = 120.0  # seconds a round waits for enough SuperNodes before the run fails
    proximal_mu: float = 0.01  # fedprox
    server_lr: float = 0.01  # fedadam, fedadagrad, fedyogi (eta)
    server_momentum: float = 0.9  # fedavgm
    strategy_args: str = ""  # any constructor argument of the strategy: "beta-1=0.8 tau=0.001" (wins over the above)
    dp_wrapper: str = ""  # Flower's DP wrapper around it: server-fixed, server-adaptive, client-fixed, client-adaptive
    dp_args: str = ""  # the wrapper's arguments: "noise-multiplier=1.0 clipping-norm=0.1 num-sampled-clients=4"
    # Trunk aggregation.
    trunk_mode: str = "sync"
    quorum: int = 2
    max_staleness: int = 4
    staleness_policy: str = "reject"
    trunk_timeout: float = 60.0
    grad_guard_norm: float = 0.0  # 0: only refuse non-finite trunk gradients
    trunk_batch_window_ms: float = 0.0  # cross-client batching of trunk forwards (0: off)
    trunk_max_batch_tokens: int = 65536  # positions one batched trunk call may hold
    trunk_max_concurrent_rpcs: int = 4096  # calls the trunk serves at once (waiting ones hold no thread)
    trunk_checkpointing: bool = False  # keep only each forward's input; recompute in its backward
    trunk_strategy: str = ""  # per-client mode: strategy that merges the trunk copies (empty: as strategy says)
    trunk_strategy_args: str = ""  # its constructor arguments, as strategy-args (empty: strategy-args if same)
    trunk_replicas: int = 1  # trunk processes over torch.distributed (one per GPU when there are GPUs)
    client_cuts: str = ""  # heterogeneous cuts "a,b a,b ...", assigned by partition id (round robin)
    micro_batches: str = "1"  # pipelined split step: micro-batches per client batch, or "auto"
    shared_memory: str = "auto"  # tensors through shared memory when client and trunk share a host: auto, on, off
    trunk_shared_memory_mib: int = 256  # shared memory each client on the trunk's host may map (0: none)
    bulk_connections: int = 0  # TCP connections of a bulk link for streamed tensors (0: none; TLS with the trunk's)
    bulk_port: int = 0  # the port the trunk's bulk links listen on (0: a free one)
    # Data.
    dataset: str = ""  # empty: the model's embedded data; else a hub dataset (needs a network)
    partitioner: str = "iid"
    dirichlet_alpha: float = 0.5
    classes_per_partition: int = 2
    # Trunk server.
    trunk_bind: str = "127.0.0.1"
    trunk_port: int = 0  # 0: a free port
    trunk_advertise: str = ""  # host:port clients dial; empty: the bound address
    trunk_insecure: bool = False  # false: plaintext on loopback, TLS elsewhere (zero-config unless tls-cert/key)
    trunk_allow_plaintext_remote: bool = False  # with trunk-insecure: plaintext on a non-loopback address too
    tls_cert: str = ""
    tls_key: str = ""
    tls_root_ca: str = ""  # node: CA that signed tls-cert (empty: the system roots)
    tls_client_ca: str = ""  # CA that signs client certificates: set, the trunk requires them (mutual TLS)
    tls_client_cert: str = ""  # node: this node's certificate for mutual TLS
    tls_client_key: str = ""  # node: its private key
    auth: bool = True  # per-client signed tokens on the split channel
    token_ttl: float = 3600.0
    wire_dtype: str = "fp32"
    wire_compression: str = "none"  # int8: activations and gradients; topk: gradients (docs/compression.md)
    wire_compression_act: str = ""  # activations: none or int8 (empty: as wire-compression says)
    wire_compression_grad: str = ""  # gradients: none, int8 or topk (empty: as wire-compression says)
    topk_ratio: float = 0.01  # fraction of a gradient's elements top-k keeps
    wire_error_feedback: bool = True  # carry each gradient's compression error into the next one
    precision: str = "fp32"  # bf16: autocast on every part
    # Privacy (see docs/privacy.md).
    dp_noise_multiplier: float = 0.0  # DP-SGD noise / clip on the client parts; 0 with dp-target-epsilon 0: off
    dp_target_epsilon: float = 0.0  # > 0: derive the noise to spend this over num-server-rounds x local steps
    dp_max_grad_norm: float = 1.0
    dp_delta: float = 1e-5
    dp_accountant: str = "prv"  # prv or rdp
    dp_unsupported: str = "error"  # or "freeze": layers opacus cannot handle
    cut_noise_clip: float = 0.0  # clip each example's activation sent to the trunk; 0: off
    cut_noise_sigma: float = 0.0
    cut_noise_eval: bool = True
    cut_grad_clip: float = 0.0  # clip each example's gradient sent back (protects labels); 0: off
    cut_grad_sigma: float = 0.0
    # Outputs.
    output_dir: str = "outputs"
    tensorboard_dir: str = ""  # TensorBoard event files of every round's metrics; relative: inside output-dir
    # Continue a run (after a crash): "" / false: a new run folder; "latest" / true: the run output-dir's `latest`
    # names; else a path to a run folder (relative: inside output-dir). See splitfed.run.rundirs.
    resume: str = ""
    metrics_port: int = -1  # Prometheus endpoint of the trunk server; -1: off, 0: free port
    log_level: str = "INFO"
    log_json: bool = False  # JSON lines with run id, round, client and step

    def updated(self, values: Mapping[str, Any]) -> RunConfig:
        """A copy with ``values`` (run-config keys) set, each checked as :meth:`from_mapping` checks it."""
        fields = {_key(f.name): f for f in dataclasses.fields(self)}
        check_keys(values)
        config = dataclasses.replace(self, **{fields[k].name: _coerce(k, fields[k], v) for k, v in values.items()})
        config.validate()
        return config

    def for_node(self, node_config: Mapping[str, Any]) -> RunConfig:
        """The run config as one node sees it: the :data:`NODE_KEYS` its ``node_config`` sets (a SuperNode's
        ``--node-config``) replace the run's values; its other keys (``partition-id``, ...) are not settings."""
        own = {key: value for key, value in node_config.items() if key in NODE_KEYS}
        return self if not own else RunConfig.from_mapping({**self.to_mapping(), **own})

    @property
    def effective_trunk_lr(self) -> float:
        """Learning rate of the trunk's optimizer."""
        return self.trunk_lr or self.lr

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunConfig:
        """Build from run-config values (kebab-case keys); unknown keys and bad values raise ConfigError."""
        fields = {_key(f.name): f for f in dataclasses.fields(cls)}
        check_keys(values)
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            f = fields[key]
            kwargs[f.name] = _coerce(key, f, value)
        config = cls(**kwargs)
        config.validate()
        return config

    def to_mapping(self) -> dict[str, Any]:
        """The settings as run-config values (for logs, outputs and tests)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[_key(f.name)] = ",".join(map(str, value)) if isinstance(value, tuple) else value
        return out

    def validate(self) -> None:
        """Check ranges and choices; raise ConfigError naming the key."""
        _choice("trunk-mode", self.trunk_mode, _MODES)
        _choice("partitioner", self.partitioner, _PARTITIONERS)
        _choice("strategy", self.strategy, _STRATEGIES)
        _choice("trunk-strategy", self.trunk_strategy, ("",) + _STRATEGIES)
        _choice("dp-wrapper", self.dp_wrapper, _DP_WRAPPERS)
        for key, text in (("strategy-args", self.strategy_args), ("trunk-strategy-args", self.trunk_strategy_args),
                          ("dp-args", self.dp_args)):
            parse_args(text, key)
        if self.client_cuts and self.trunk_mode == "per-client":
            raise ConfigError("client-cuts and trunk-mode = 'per-client' do not combine yet (the trunk's per-client "
                              "copies hold its whole range); use sync, async, quorum or sequential with client-cuts")
        if self.trunk_strategy and self.trunk_mode != "per-client":
            raise ConfigError(f"trunk-strategy merges per-client trunk copies: set trunk-mode = 'per-client' or "
                              f"leave trunk-strategy empty (trunk-mode is {self.trunk_mode!r})")
        if self.micro_batches != "auto" and not (self.micro_batches.isdigit() and int(self.micro_batches) >= 1):
            raise ConfigError(f"micro-batches must be 'auto' or an integer >= 1, got {self.micro_batches!r}")
        if self.micro_batches != "1" and self.trunk_batch_window_ms > 0:
            raise ConfigError("micro-batches needs trunk-batch-window-ms = 0: a cross-client batch's backward is one "
                              "contribution of all its clients, so it cannot hold one micro-batch of a step")
        if self.client_cuts:
            parse_client_cuts(self.client_cuts)
        _choice("optimizer", self.optimizer, _OPTIMIZERS)
        _choice("wire-dtype", self.wire_dtype, _WIRE)
        _choice("wire-compression", self.wire_compression, ("none", "int8", "topk"))
        _choice("shared-memory", self.shared_memory, ("auto", "on", "off"))
        _choice("wire-compression-act", self.wire_compression_act, ("", "none", "int8"))
        _choice("wire-compression-grad", self.wire_compression_grad, ("", "none", "int8", "topk"))
        if not 0.0 < self.topk_ratio <= 1.0:
            raise ConfigError(f"topk-ratio must be in (0, 1], got {self.topk_ratio}")
        _choice("precision", self.precision, _PRECISION)
        _choice("staleness-policy", self.staleness_policy, ("reject", "downweight"))
        for key, value, low in [("num-server-rounds", self.num_server_rounds, 1), ("batch-size", self.batch_size, 1),
                                ("quorum", self.quorum, 1), ("max-staleness", self.max_staleness, 0),
                                ("local-steps", self.local_steps, 0), ("local-epochs", self.local_epochs, 0),
                                ("max-seq-len", self.max_seq_len, 2), ("min-train-nodes", self.min_train_nodes, 1),
                                ("eval-batches", self.eval_batches, 0), ("lora-rank", self.lora_rank, 0),
                                ("classes-per-partition",
                                                                          self.classes_per_partition, 1),
                                ("trunk-max-batch-tokens", self.trunk_max_batch_tokens, 1),
                                ("trunk-max-concurrent-rpcs", self.trunk_max_concurrent_rpcs, 1),
                                ("trunk-replicas", self.trunk_replicas, 1),
                                ("trunk-shared-memory-mib", self.trunk_shared_memory_mib, 0),
                                ("bulk-connections", self.bulk_connections, 0)]:
            if value < low:
                raise ConfigError(f"{key} must be >= {low}, got {value}")
        if self.trunk_replicas > 1 and self.trunk_mode not in ("sync", "async", "quorum"):
            raise ConfigError(f"trunk-replicas = {self.trunk_replicas} needs trunk-mode sync, async or quorum, got "
                              f"{self.trunk_mode!r}; set trunk-replicas = 1")
        if self.trunk_replicas > 1 and self.bulk_connections:
            raise ConfigError("bulk-connections needs trunk-replicas = 1 (the router in front of the replicas does not "
                              "route bulk links); set bulk-connections = 0")
        if self.trunk_replicas > 1 and self.client_cuts:
            raise ConfigError("trunk-replicas > 1 does not combine with client-cuts yet (the round-end merge of "
                              "the trunk's blocks updates one replica); set trunk-replicas = 1")
        if self.local_steps == 0 and self.local_epochs == 0:
            raise ConfigError("local-steps and local-epochs are both 0; set one of them")
        if self.trunk_batch_window_ms < 0:
            raise ConfigError(f"trunk-batch-window-ms must be >= 0, got {self.trunk_batch_window_ms}")
        for key, value in [("lr", self.lr), ("trunk-timeout", self.trunk_timeout),
                           ("node-wait-timeout", self.node_wait_timeout),
                           ("dirichlet-alpha", self.dirichlet_alpha), ("token-ttl", self.token_ttl)]:
            if not value > 0:
                raise ConfigError(f"{key} must be > 0, got {value}")
        for key, value in [("fraction-train", self.fraction_train), ("fraction-evaluate", self.fraction_evaluate),
                           ("accept-failures", self.accept_failures)]:
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{key} must be in [0, 1], got {value}")
        if not 0 <= self.trunk_port <= 65535:
            raise ConfigError(f"trunk-port must be in 0..65535, got {self.trunk_port}")
        if not 0 <= self.bulk_port <= 65535:
            raise ConfigError(f"bulk-port must be in 0..65535, got {self.bulk_port}")
        from splitfed.channel.security.policy import choose_mode  # lazy: keeps config import-light

        # ConfigError for plaintext off loopback by omission, or half a TLS key pair.
        choose_mode(self.trunk_bind, advertise=self.trunk_advertise, insecure=self.trunk_insecure,
                    allow_plaintext_remote=self.trunk_allow_plaintext_remote, tls_cert=self.tls_cert,
                    tls_key=self.tls_key, tls_client_ca=self.tls_client_ca)
        if bool(self.tls_client_cert) != bool(self.tls_client_key):
            raise ConfigError("tls-client-cert and tls-client-key go together: set both to a node's certificate "
                              "and private key, or neither")
        if self.trunk_advertise and ":" not in self.trunk_advertise:
            raise ConfigError(f"trunk-advertise must be host:port, got {self.trunk_advertise!r}")
        from splitfed.privacy import PrivacyConfig  # lazy: keeps config import-light

        PrivacyConfig.from_mapping(self.to_mapping())  # ConfigError naming the privacy key


def known_keys() -> list[str]:
    """Every run-config key, sorted."""
    return sorted(_key(f.name) for f in dataclasses.fields(RunConfig))


def check_keys(keys: Iterable[str]) -> None:
    """Raise ConfigError naming the first key that is not a run-config key, and the closest one that is."""
    known = known_keys()
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"unknown run-config key {key!r}; {hint}known keys: {', '.join(known)}")


def override_keys(text: str) -> list[str]:
    """The keys of a ``flwr run --run-config`` string (``"key=value key='text' ..."``)."""
    return [token.split("=", 1)[0].strip() for token in shlex.split(text) if token.strip()]


#: Settings that belong to a node, not to the run: files on that node's disk. A SuperNode's ``--node-config``
#: overrides them (``flower-supernode --node-config "tls-client-cert='/etc/splitfed/node.pem' ..."``).
NODE_KEYS = ("tls-client-cert", "tls-client-key", "tls-root-ca")


def parse_args(text: str, key: str) -> dict[str, str]:
    """Parse a ``name=value`` list (``strategy-args``, ``dp-args``): names kebab- or snake-case, returned in
    snake case (a constructor's argument names); values as text (the strategy factory types them).

    Raises ConfigError naming ``key`` when an entry is not ``name=value`` or a name appears twice.
    """
    try:
        tokens = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(f"{key} = {text!r} is not valid: {exc}") from None
    out: dict[str, str] = {}
    for token in tokens:
        name, sep, value = token.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name.isidentifier():
            raise ConfigError(f"{key} entries must be name=value (e.g. {key}='beta-1=0.8 tau=0.001'), got {token!r}")
        if name in out:
            raise ConfigError(f"{key} sets {name.replace('_', '-')} twice")
        out[name] = value.strip()
    return out


def parse_client_cuts(text: str) -> list[tuple[int, int]]:
    """Parse ``client-cuts`` ("a,b a,b ..."): one (bottom end, top start) pair per entry, 0 < a < b.

    Raises ConfigError naming the key when an entry is not two integers in order.
    """
    cuts: list[tuple[int, int]] = []
    for entry in text.split():
        try:
            a, b = (int(v) for v in entry.split(","))
        except ValueError:
            raise ConfigError(f"client-cuts entries must be 'a,b' (two integers), got {entry!r} in {text!r}") from None
        if not 0 < a < b:
            raise ConfigError(f"client-cuts entry {entry!r} must satisfy 0 < a < b (the trunk runs blocks [a, b))")
        cuts.append((a, b))
    if not cuts:
        raise ConfigError("client-cuts is set but holds no 'a,b' entry")
    return cuts


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {value!r}")


#: What a value of each field type must look like, in the words of an error message.
_EXPECTED = {"tuple": "two integers A,B (e.g. \"3,6\")", "bool": "true or false", "int": "an integer",
             "float": "a number", "str": "a string"}


def _coerce(key: str, f: dataclasses.Field[Any], value: Any) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    expected = next((v for k, v in _EXPECTED.items() if kind.startswith(k)), kind)
    try:
        if kind.startswith("tuple"):
            if value in ("", None):
                return None
            parts = [int(v) for v in str(value).split(",")] if not isinstance(value, (list, tuple)) else \
                [int(v) for v in value]
            if len(parts) != 2:
                raise ValueError(expected)
            return tuple(parts)
        if key == "resume":  # false / true / "latest" / a run's path
            text = str(value).strip()
            return "" if text.lower() in ("", "false", "0", "no") else \
                "latest" if text.lower() in ("true", "1", "yes", "latest") else text
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes"):
                return True
            if str(value).lower() in ("false", "0", "no"):
                return False
            raise ValueError(expected)
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(expected)
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError(expected)
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"run-config key {key!r} = {value!r} is not valid: {key} must be {expected}") from None


__all__ = ["NODE_KEYS", "RunConfig", "check_keys", "known_keys", "override_keys", "parse_args", "parse_client_cuts"]
