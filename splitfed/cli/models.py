"""``splitfed serve`` with several models, and ``splitfed models list|load|unload|reload`` (the admin service's CLI).

``--model`` repeats, each ``[NAME=]SOURCE[:A,B]`` (a named model, a local folder
or a hub id; the name clients ask for; the cuts) and, in the same argument, any
models-file key as ``KEY=VALUE`` (``lora-rank=4 lora-targets=q_proj,v_proj``), the
other ``serve`` options being every model's defaults; ``--models-file F.toml`` gives each model a table of its
own (:mod:`splitfed.serving.spec`). ``--admin-token-file`` turns the admin service
on; ``--max-memory`` bounds what the models may take per device.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from splitfed.cli.lifetime import serve_until_signalled
from splitfed.errors import SplitFedError

log = logging.getLogger("splitfed")

TOKEN_ENV = "SPLITFED_ADMIN_TOKEN"


# -- serve ---------------------------------------------------------------------------------------
def add_serve_options(serve: argparse.ArgumentParser) -> None:
    """The ``serve`` options for several models, the admin service and the memory budget."""
    serve.add_argument("--models-file", help="TOML file with one [models.NAME] table per model (model, cuts, "
                                             "lora-rank, device, trunk-mode, ...); see docs/serving.md")
    serve.add_argument("--device", default=None,
                       help="device of every --model (cpu, cuda, cuda:N; default: cpu); with --replicas N: cpu, or "
                            "cuda for replica r on cuda:r (default: a GPU per replica when there are enough, else "
                            "cpu)")
    serve.add_argument("--admin-token-file", help="file holding the admin service's token (16+ characters, never "
                                                  f"a client's); also ${TOKEN_ENV}. Without one the service is off")
    serve.add_argument("--admin-token", help="the admin token itself (visible in the process list: prefer "
                                             "--admin-token-file)")
    serve.add_argument("--max-memory", action="append", default=[],
                       help="bytes the models may take per device: DEVICE=SIZE (cpu=8GiB, cuda:0=20GiB) or SIZE "
                            "for every device; repeatable")
    serve.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free one)")
    serve.add_argument("--frontends", type=int, default=0,
                       help="take calls in with this many front-end processes sharing --port, so gRPC's per-call "
                            "work runs on several cores (many clients on one GPU; default: %(default)s, the "
                            "server's own event loop); see docs/performance.md")
    serve.add_argument("--bulk-connections", type=int, default=0,
                       help="offer clients bulk links of up to this many TCP connections for the bytes of large "
                            "tensors (TLS with --tls-cert/--tls-key, as the channel; 0: none, the default); see "
                            "docs/performance.md")
    serve.add_argument("--bulk-port", type=int, default=0,
                       help="the port bulk links listen on, beside --port (for a firewall; 0: a free one, the "
                            "default)")


def spec_from_flag(text: str, args: argparse.Namespace) -> Any:
    """The spec of one ``--model '[NAME=]SOURCE[:A,B] [KEY=VALUE ...]'``, the other ``serve`` options its defaults
    (:func:`splitfed.serving.spec.parse_model_flag`)."""
    from splitfed.serving.spec import parse_model_flag

    defaults = {key: getattr(args, key, None) for key in (
        "cuts", "lora_rank", "lora_alpha", "lora_targets", "device", "trunk_mode", "quorum", "max_staleness",
        "trunk_timeout", "optimizer", "lr", "batch_window_ms", "max_batch_tokens", "checkpointing", "compile",
        "shared_memory_mib", "seed")}
    return parse_model_flag(text, {k: v for k, v in defaults.items() if v is not None})


def read_token(args: argparse.Namespace) -> str | None:
    """The admin token from ``--admin-token-file``, ``--admin-token`` or ``$SPLITFED_ADMIN_TOKEN`` (None: none)."""
    if getattr(args, "admin_token_file", None):
        try:
            with open(args.admin_token_file) as f:
                return f.read().strip()
        except OSError as exc:
            raise SystemExit(f"cannot read the admin token file {args.admin_token_file}: {exc.strerror}") from None
    return getattr(args, "admin_token", None) or os.environ.get(TOKEN_ENV) or None


def read_pem(path: str) -> bytes:
    """The bytes of a PEM file named on the command line (exits saying why it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise SystemExit(f"cannot read {path}: {exc.strerror}") from None


def serve_models(args: argparse.Namespace) -> int:
    """``splitfed serve``: every ``--model`` and ``--models-file`` model on one port, until SIGTERM."""
    from splitfed.channel.server.trunkserver import TrunkServer
    from splitfed.serving.memory import parse_budget
    from splitfed.serving.spec import read_models_file

    if getattr(args, "replicas", 1) > 1:
        raise SystemExit("--replicas serves one --model (no --models-file); serve several models without replicas")
    try:
        specs = read_models_file(args.models_file) if args.models_file else []
        specs += [spec_from_flag(text, args) for text in args.model or []]
        names = [s.name for s in specs]
        if not specs:
            raise SystemExit("give --model (repeatable) or --models-file")
        if len(set(names)) != len(names):
            raise SystemExit(f"two models are named {sorted({n for n in names if names.count(n) > 1})}; name them "
                             "apart with --model NAME=SOURCE")
        credentials = frontend_tls = bulk_tls = None
        if not args.insecure:
            from splitfed.channel.security.credentials import server_credentials

            if not (args.tls_cert and args.tls_key):
                raise SystemExit("give --tls-cert and --tls-key (and --tls-client-ca for mutual TLS), or --insecure "
                                 "to serve plaintext")
            credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
            if args.bulk_connections:
                from splitfed.channel.security.bulktls import server_context

                bulk_tls = server_context(read_pem(args.tls_cert), read_pem(args.tls_key),
                                          read_pem(args.tls_client_ca) if args.tls_client_ca else None)
            if args.frontends:
                frontend_tls = (read_pem(args.tls_key), read_pem(args.tls_cert),
                                read_pem(args.tls_client_ca) if args.tls_client_ca else None)
        if args.frontends < 0:
            raise SystemExit(f"--frontends must be 0 or more, not {args.frontends}")
        server = TrunkServer(host=args.host, port=args.port, insecure=args.insecure, credentials=credentials,
                             models=specs, admin_token=read_token(args), max_memory=parse_budget(args.max_memory),
                             metrics_port=args.metrics_port, metrics_host=args.host, frontends=args.frontends,
                             frontend_tls=frontend_tls, bulk_connections=args.bulk_connections,
                             bulk_tls=bulk_tls, bulk_port=args.bulk_port,
                             authenticate=getattr(args, "authenticate", None)).start()
    except SplitFedError as exc:
        raise SystemExit(f"splitfed serve: {exc}") from None
    failed = sorted(n for n, state in server.models().items() if state.value == "FAILED")
    log.info("serving %s on %s%s", ", ".join(n for n in names if n not in failed), server.address,
             f" (refused: {', '.join(failed)}; `splitfed models list` says why)" if failed else "")
    return serve_until_signalled(server.wait, server.stop)


# -- models --------------------------------------------------------------------------------------
def _spec_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="named model, local folder or hub id")
    parser.add_argument("--name", default="", help="what clients ask for (default: the model)")
    parser.add_argument("--cuts", help="cut points A,B: the trunk holds blocks A..B-1")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--lora-alpha", type=float, default=0.0, help="LoRA's alpha (default: twice the rank)")
    parser.add_argument("--lora-targets", default="",
                        help="the modules LoRA adapts, comma-separated (default: the architecture's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--trunk-mode", default="sync", choices=["sync", "async", "quorum"])
    parser.add_argument("--quorum", type=int, default=1)
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--trunk-timeout", type=float, default=60.0)
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam", "adamw"])
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch-window-ms", type=float, default=0.0)
    parser.add_argument("--max-batch-tokens", type=int, default=65536)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true", help="compile the trunk's blocks with torch.compile")
    parser.add_argument("--shared-memory-mib", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frozen", action="store_true", help="inference only: no optimizer")


def add_models_command(sub: Any) -> None:
    """``splitfed models list|load|unload|reload --server ADDR``."""
    models = sub.add_parser("models", help="list, load, unload or reload the models of a running trunk server")
    verbs = models.add_subparsers(dest="verb", required=True)
    for verb, text in (("list", "every model with its state, cuts, trunk mode and bytes per device"),
                       ("load", "load a model while the others serve"),
                       ("unload", "unload a model: calls in flight finish, new ones are refused"),
                       ("reload", "unload a model and load it again from its source")):
        p = verbs.add_parser(verb, help=text)
        p.add_argument("--server", required=True, help="host:port of the trunk server")
        p.add_argument("--admin-token-file", help=f"file holding the admin token (also ${TOKEN_ENV})")
        p.add_argument("--admin-token", help="the admin token itself (visible in the process list)")
        p.add_argument("--tls-ca", help="root CA of the server's certificate (required off loopback)")
        p.add_argument("--json", action="store_true", help="print JSON")
        if verb == "load":
            _spec_options(p)
        if verb in ("unload", "reload"):
            p.add_argument("name", help="the model's name on the server")
            p.add_argument("--drain-timeout", type=float, help="seconds calls in flight may take (default 30)")
        if verb in ("load", "reload"):
            p.add_argument("--no-wait", action="store_true", help="answer at once (LOADING) instead of when READY")
        p.set_defaults(func=run_models)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _print(statuses: list[dict[str, Any]], as_json: bool, budget: dict[str, int] | None = None) -> None:
    if as_json:
        sys.stdout.write(json.dumps({"models": statuses, **({"budget": budget} if budget is not None else {})},
                                    indent=1) + "\n")
        return
    rows = [("NAME", "STATE", "MODEL", "CUTS", "MODE", "LORA", "BYTES", "VERSION")]
    for s in statuses:
        held = ", ".join(f"{d} {_mib(n)}" for d, n in s["bytes"].items()) or "-"
        rows.append((s["name"] or "(unnamed)", s["state"], s["model"] or "-",
                     ",".join(map(str, s["cuts"])) or "-", s["trunk_mode"] or "-", str(s["lora_rank"]), held,
                     str(s["trunk_version"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")
    for s in statuses:
        if s["error"]:
            sys.stdout.write(f"{s['name']}: {s['error']}\n")
    if budget:
        sys.stdout.write("budget: " + ", ".join(f"{d if d != '*' else 'every device'} {_mib(n)}"
                                                for d, n in sorted(budget.items())) + "\n")


def run_models(args: argparse.Namespace) -> int:
    """Run one ``splitfed models`` verb; errors end the command with their status and message."""
    from splitfed.channel.admin.client import AdminClient, status_dict
    from splitfed.serving.spec import ModelSpec, parse_cuts

    token = read_token(args)
    if not token:
        raise SystemExit(f"give the admin token: --admin-token-file F (or ${TOKEN_ENV})")
    try:
        credentials = None
        if args.tls_ca:
            from splitfed.channel.security.credentials import channel_credentials

            credentials = channel_credentials(args.tls_ca)
        with AdminClient(args.server, token, credentials=credentials, insecure=credentials is None) as admin:
            if args.verb == "list":
                reply = admin.list()
                _print([status_dict(m) for m in reply.models], args.json, dict(reply.budget))
                return 0
            if args.verb == "load":
                spec = ModelSpec(model=args.model, name=args.name, cuts=parse_cuts(args.cuts),
                                 lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                                 lora_targets=args.lora_targets, device=args.device, trunk_mode=args.trunk_mode,
                                 quorum=args.quorum, max_staleness=args.max_staleness, trunk_timeout=args.trunk_timeout,
                                 optimizer=args.optimizer, lr=args.lr, batch_window_ms=args.batch_window_ms,
                                 max_batch_tokens=args.max_batch_tokens, checkpointing=args.checkpointing,
                                 compile=args.compile, shared_memory_mib=args.shared_memory_mib, seed=args.seed,
                                 frozen=args.frozen)
                status = admin.load(spec, wait=not args.no_wait)
            elif args.verb == "unload":
                status = admin.unload(args.name, drain_timeout_s=args.drain_timeout)
            else:
                status = admin.reload(args.name, wait=not args.no_wait, drain_timeout_s=args.drain_timeout)
    except SplitFedError as exc:
        raise SystemExit(f"splitfed models {args.verb}: {exc}") from None
    done = status_dict(status)
    if args.verb == "unload":
        done["state"] = "UNLOADED"
    _print([done], args.json)
    return 0
