"""The ``splitfed`` console command: ``serve`` trunks standalone, manage their ``models``, ``generate`` text,
``report`` a run's history."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from splitfed.cli.lifetime import serve_until_signalled, stacks_on_sigusr1
from splitfed.errors import ConfigError, SplitFedError

log = logging.getLogger("splitfed")


def _cuts(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cuts must be two integers A,B, got {text!r}") from None
    return a, b


def _build_server(rank: int, args: argparse.Namespace) -> Any:
    """Replica ``rank``'s trunk server for ``splitfed serve`` (not started); with several replicas, rank r listens on
    ``--port`` + 1 + r (the router takes ``--port``) and, with a GPU each, computes on ``cuda:r``."""
    if not args.insecure and not (args.tls_cert and args.tls_key):  # before anything heavy loads
        raise ConfigError("give --tls-cert and --tls-key (and --tls-client-ca for mutual TLS), or --insecure "
                          "to serve plaintext")
    from splitfed.channel.server.trunkserver import TrunkServer
    from splitfed.config import RunConfig
    from splitfed.models.parts import build_parts, is_pretrained, model_cuts
    from splitfed.trunk.aggregation.modes import make_aggregator
    from splitfed.trunk.inference.sessions import SessionLimits
    from splitfed.trunk.replicas.group import replica_aggregator

    cfg = RunConfig(model=args.model, cuts=args.cuts, seed=args.seed, lora_rank=args.lora_rank,
                    lora_alpha=args.lora_alpha, lora_targets=args.lora_targets)
    if cfg.cuts is None and is_pretrained(cfg):
        from splitfed.models.llm import NAMED_LLMS, load_config

        if cfg.model not in NAMED_LLMS:
            load_config(cfg.model)  # ModelLoadError naming the named models when there is no such model
            raise ConfigError(f"--cuts A,B is required for {cfg.model} (only named models have default cuts)")
    cuts = model_cuts(cfg)
    # A pretrained model's trunk is read alone from the checkpoint (part-only loading).
    parts = build_parts(cfg, ("trunk",) if is_pretrained(cfg) else ("bottom", "trunk", "top"))
    credentials = frontend_tls = None
    if not args.insecure:
        from splitfed.channel.security.credentials import server_credentials

        credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
        if args.frontends:
            from splitfed.cli.models import read_pem

            frontend_tls = (read_pem(args.tls_key), read_pem(args.tls_cert),
                            read_pem(args.tls_client_ca) if args.tls_client_ca else None)
    trunk = parts.trunk
    if args.replicas > 1:
        from splitfed.run.launcher import replica_device

        trunk = trunk.to(replica_device(rank, args.replicas, args.device))
    aggregator = (replica_aggregator if args.replicas > 1 else make_aggregator)(
        args.trunk_mode, quorum=args.quorum, max_staleness=args.max_staleness, timeout=args.trunk_timeout)
    port = args.port + rank + (1 if args.replicas > 1 else 0) if args.port else 0
    return TrunkServer(trunk, host=args.host, port=port, insecure=args.insecure,
                       credentials=credentials, optimizer=args.optimizer, lr=args.lr, aggregator=aggregator,
                       model_name=args.model, cuts=cuts, batch_window_ms=args.batch_window_ms,
                       max_batch_tokens=args.max_batch_tokens, checkpointing=args.checkpointing,
                       compile=args.compile, shared_memory_bytes=args.shared_memory_mib << 20, frontends=args.frontends,
                       frontend_tls=frontend_tls, authenticate=getattr(args, "authenticate", None),
                       session_limits=SessionLimits(decode_steps=args.decode_steps))


def _serve(args: argparse.Namespace) -> int:
    from splitfed.cli.security import server_security

    args.authenticate = server_security(args)  # TLS flags, plaintext off loopback, the clients' token
    if args.replicas > 1 and args.bulk_connections:
        raise SystemExit("splitfed serve: --bulk-connections needs --replicas 1 (the router does not route bulk "
                         "links)")
    if args.replicas <= 1 or args.models_file or len(args.model or []) != 1:
        from splitfed.cli.models import serve_models

        return serve_models(args)  # one or several models on one port (and the admin service)
    args.model = args.model[0]
    from splitfed.run.launcher import replica_device

    for rank in range(args.replicas):  # every replica's device, before anything loads
        replica_device(rank, args.replicas, args.device)
    server = _build_server(0, args).start()
    replicas = router = None
    if args.replicas > 1:
        from splitfed.cli.route import replica_router
        from splitfed.run.launcher import ReplicaSet

        replicas = ReplicaSet(server, args.replicas, _build_server, (args,), timeout_s=max(args.trunk_timeout * 2,
                                                                                             60.0)).start()
        router = replica_router(args, replicas.addresses, replicas.gone).start()  # one address in front of the replicas
    log.info("serving the trunk of %s on %s", args.model, server.address if router is None else
             f"{router.address} (replicas: {', '.join(replicas.addresses)})")

    def stop(*_: object) -> None:
        if router is not None:
            router.stop()
        if replicas is not None:
            replicas.stop()
        server.stop()

    return serve_until_signalled(server.wait, stop)


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from splitfed.run.report import load_history, plot, run_folder, runs_table, summary_table

    history = load_history(args.output_dir)
    folder = run_folder(args.output_dir)
    if folder != Path(args.output_dir):  # an output-dir of several runs: list them, report the latest
        sys.stdout.write(runs_table(args.output_dir) + f"\nreport of {folder}:\n")
    written = plot(history, args.plots_dir or (folder if folder.is_dir() else folder.parent))
    sys.stdout.write(summary_table(history) + "\n")
    sys.stdout.write("plots: " + ", ".join(str(p) for p in written) + "\n")
    return 0


class _TextStream:
    """Writes the text of the first sequence's new tokens to a stream as they come."""

    def __init__(self, tokenizer: Any, out: TextIO) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.written = 0

    def __call__(self, tokens: Any) -> None:
        self.ids.append(int(tokens[0]))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its other bytes
            return
        self.out.write(text[self.written:])
        self.out.flush()
        self.written = len(text)


def _generate(args: argparse.Namespace) -> int:
    from splitfed.models import llm
    from splitfed.models.partload import load_parts
    from splitfed.channel.client.trunk import TrunkClient
    from splitfed.channel.server.trunkserver import TrunkServer
    from splitfed.client.generation import RemoteSession, generate
    from splitfed.models.catalog import NAMED

    causal = [m.name for m in llm.NAMED_LLMS.values() if m.task == "causal-lm"]
    if args.model in NAMED or (args.model in llm.NAMED_LLMS and args.model not in causal):
        raise ConfigError(f"{args.model} cannot generate text: generate needs a pretrained causal LM with a "
                          f"tokenizer, a named one ({', '.join(causal)}), a save_pretrained folder (e.g. a language "
                          "model run's outputs/model) or a hub id")
    config = llm.load_config(args.model)
    n = int(config.num_hidden_layers)
    cuts = args.cuts or (llm.NAMED_LLMS[args.model].default_cuts if args.model in llm.NAMED_LLMS
                         else (1, max(n - 1, 2)))
    # With a remote trunk the client reads only its own parts' weights.
    roles = ("bottom", "top") if args.trunk else ("bottom", "trunk", "top")
    parts = load_parts(args.model, cuts, roles)
    for role in roles:
        getattr(parts, role).eval()
    tokenizer = llm.load_tokenizer(args.model)
    server = None
    if args.trunk:
        credentials = None
        if not args.insecure:
            from splitfed.channel.security.credentials import channel_credentials

            credentials = channel_credentials(args.tls_ca)
        client = TrunkClient(args.trunk, insecure=args.insecure, credentials=credentials, token=args.token,
                             model=args.trunk_model)
        served = tuple(client.info().cuts)
        if served and served != tuple(cuts):
            client.close()
            raise ConfigError(f"the trunk server at {args.trunk} serves cuts {served[0]},{served[1]}; pass "
                              f"--cuts {served[0]},{served[1]}")
    else:
        parts.trunk.requires_grad_(False)  # inference only: no trunk optimizer
        server = TrunkServer(parts.trunk, host="127.0.0.1", port=0, insecure=True, model_name=args.model,
                             cuts=cuts).start()
        client = TrunkClient(server.address, insecure=True)
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             tokenize=False, add_generation_prompt=True)
    input_ids = tokenizer(text, return_tensors="pt").input_ids
    eos = {t for t in (tokenizer.eos_token_id,) if t is not None}
    config_eos = getattr(config, "eos_token_id", None)
    eos |= set(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
    try:
        with RemoteSession(client, input_ids.shape[1] + args.max_new_tokens) as session:
            generate(parts.bottom, session, parts.top, input_ids, max_new_tokens=args.max_new_tokens,
                     temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, eos_token_id=sorted(eos),
                     streamer=_TextStream(tokenizer, sys.stdout), seed=args.seed)
        sys.stdout.write("\n")
    finally:
        client.close()
        if server is not None:
            server.stop(grace=0)
    return 0


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class CommandParser(argparse.ArgumentParser):
    """An argument parser that takes ``--log-level``, as do the parsers of its subcommands (argparse makes them of
    the same class): ``splitfed --log-level DEBUG serve ...`` and ``splitfed serve --log-level DEBUG ...`` alike.

    Only the top-level parser has a default (INFO); a subcommand's option sets the level only when given, so it
    never undoes one given before the subcommand.
    """

    def __init__(self, *args: Any, log_level_default: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS,
                          default=log_level_default or argparse.SUPPRESS,
                          help="logging level (DEBUG shows every step, and the traceback of an error; default: "
                               "INFO); before or after the subcommand")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``splitfed`` command."""
    parser = CommandParser(prog="splitfed", description="Split learning for Flower.", log_level_default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model's trunk over the split channel")
    serve.add_argument("--model", action="append", help="named model (mnist-cnn), local folder or hub id, as "
                       "[NAME=]SOURCE[:A,B]; repeat it to serve several models (see docs/serving.md)")
    serve.add_argument("--cuts", type=_cuts, help="cut points A,B: the trunk holds blocks A..B-1")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces: then "
                       "clients need --token-file's token or a client certificate)")
    serve.add_argument("--port", type=int, default=50051,
                       help="port to listen on (default: %(default)s; 0: a free one); a port in use is refused")
    serve.add_argument("--insecure", action="store_true", help="serve plaintext (loopback and tests only; "
                       "elsewhere also --allow-insecure-remote)")
    serve.add_argument("--tls-cert", help="server certificate chain (PEM)")
    serve.add_argument("--tls-key", help="server private key (PEM)")
    serve.add_argument("--tls-client-ca", help="CA that signs client certificates: require mutual TLS")
    from splitfed.cli.security import add_security_options

    add_security_options(serve)
    serve.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"],
                       help="the trunk's optimizer (default: %(default)s)")
    serve.add_argument("--lr", type=float, default=0.01, help="the trunk's learning rate (default: %(default)s)")
    serve.add_argument("--trunk-mode", default="sync", choices=["sync", "async", "quorum"],
                       help="when client gradients update the trunk (default: %(default)s)")
    serve.add_argument("--quorum", type=int, default=1, help="quorum mode: gradients per step (default: %(default)s)")
    serve.add_argument("--max-staleness", type=int, default=4,
                       help="async and quorum: trunk versions a gradient may lag (default: %(default)s)")
    serve.add_argument("--trunk-timeout", type=float, default=60.0,
                       help="seconds of silence after which a client leaves the step group (default: %(default)s)")
    serve.add_argument("--batch-window-ms", type=float, default=0.0,
                       help="batch concurrent clients' trunk forwards arriving within this window (0: off)")
    serve.add_argument("--shared-memory-mib", type=int, default=256,
                       help="shared memory each client on this host may map for its tensors (0: none; every "
                            "tensor then travels over the socket)")
    serve.add_argument("--checkpointing", action="store_true",
                       help="activation checkpointing: keep only each forward's input, recompute in the backward")
    serve.add_argument("--compile", action="store_true",
                       help="compile the trunk's blocks with torch.compile (far less host time per batch; results "
                            "match the eager trunk to float rounding)")
    serve.add_argument("--decode-steps", choices=("auto", "graphs", "fixed", "dynamic"), default="auto",
                       help="how inference sessions' decode steps run: auto (CUDA graphs on a GPU), graphs, fixed "
                            "(a fixed-size KV cache without graphs) or dynamic (a growing cache)")
    serve.add_argument("--max-batch-tokens", type=int, default=65536,
                       help="positions (batch x length) one batched trunk call may hold")
    serve.add_argument("--replicas", type=int, default=1,
                       help="trunk replicas over torch.distributed (one per GPU when there are enough, else CPU "
                            "processes) behind a router on --port; replica r also listens on --port + 1 + r")
    serve.add_argument("--seed", type=int, default=0, help="seed of a trunk built untrained (default: %(default)s)")
    serve.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank on the trunk "
                       "(each --model's default: models without default LoRA targets, as mnist-cnn, get none)")
    serve.add_argument("--lora-alpha", type=float, default=0.0, help="LoRA's alpha (default: twice the rank)")
    serve.add_argument("--lora-targets", default="", help="modules LoRA adapts, a,b (default: the architecture's "
                       "projections); per model: --model 'NAME=SOURCE lora-targets=a,b'")
    serve.set_defaults(func=_serve)
    from splitfed.cli.models import add_models_command, add_serve_options

    add_serve_options(serve)
    add_models_command(sub)

    gen = sub.add_parser("generate", help="generate text with a split model (the trunk's KV cache on a server)")
    gen.add_argument("--model", required=True, help="local folder, named LLM or hub id of a causal LM")
    gen.add_argument("--cuts", type=_cuts, help="cut points A,B (default: the named model's cuts, else 1,N-1: "
                                                "the first and last blocks on the client)")
    gen.add_argument("--prompt", required=True, help="the text to continue (see --chat)")
    gen.add_argument("--max-new-tokens", type=int, default=64,
                     help="tokens to generate at most (default: %(default)s; fewer when the model ends the text)")
    gen.add_argument("--trunk", help="host:port of a trunk server (default: serve the trunk on 127.0.0.1)")
    gen.add_argument("--insecure", action="store_true", help="plaintext to --trunk (loopback and tests only)")
    gen.add_argument("--tls-ca", help="root CA that signs the trunk server's certificate (default: system roots)")
    gen.add_argument("--token", default=os.environ.get("SPLITFED_TOKEN"),
                     help="bearer token for a trunk server that requires one (default: $SPLITFED_TOKEN)")
    gen.add_argument("--trunk-model", default="", help="the model's name on a --trunk server that holds several")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sample")
    gen.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    gen.add_argument("--top-p", type=float, help="sample among the most likely tokens of this total probability")
    gen.add_argument("--seed", type=int, help="seed of the sampler")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.set_defaults(func=_generate)

    from splitfed import chat
    from splitfed.cli import route as cli_route

    cli_route.add_parser(sub)
    chat.add_parser(sub)

    report = sub.add_parser("report", help="plots and a summary table from a run's history.json")
    report.add_argument("output_dir", help="a run's folder (holding history.json), or an output-dir: its runs are "
                        "listed and the latest one reported")
    report.add_argument("--plots-dir", help="where to write the PNGs (default: the output-dir)")
    report.set_defaults(func=_report)
    return parser


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed subcommand. An error ends it with one line on stderr (``splitfed <command>: error: ...``) and
    exit status 1; ``--log-level DEBUG`` adds the traceback. Every subcommand runs through here."""
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:  # a command that stopped with a message: the same one line
        if not isinstance(exc.code, str):
            raise
        message = exc.code.removeprefix(f"splitfed {args.command}: ")
        if getattr(args, "verb", None):
            message = message.removeprefix(f"splitfed {args.command} {args.verb}: ")
        sys.stderr.write(f"splitfed {args.command}: error: {' '.join(message.split())}\n")
        return 1
    except Exception as exc:  # noqa: BLE001 - the command's one line; the traceback with DEBUG
        if log.isEnabledFor(logging.DEBUG):
            log.exception("splitfed %s failed", args.command)
        # A KeyError's str() quotes its message.
        message = exc.args[0] if isinstance(exc, KeyError) and len(exc.args) == 1 else str(exc)
        if not isinstance(exc, (SplitFedError, OSError)):
            message = f"{type(exc).__name__}: {message} (a bug? --log-level DEBUG shows where)"
        sys.stderr.write(f"splitfed {args.command}: error: {' '.join(str(message).split())}\n")
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``splitfed`` console command."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stacks_on_sigusr1()
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
