"""nginx as the split channel's proxy: its configuration written from what the trunk servers serve, checked, run.

:func:`render` turns a :class:`~splitfed.channel.routing.discovery.Discovery` into an nginx configuration that does
what clients of :class:`~splitfed.channel.routing.router.Router` rely on, in nginx's own data path:

* **by model**: a ``map`` of the ``x-splitfed-model`` header picks an upstream group per model (the live servers
  that serve it); a call naming no model goes to any server; a model no server serves is answered NOT_FOUND by
  nginx, naming the models it routes.
* **sticky**: every group is a consistent hash (``hash ... consistent``) of the ``x-splitfed-client`` header (a
  client without one: its connection), so a Forward and its Backward, an inference session's steps and a
  shared-memory region's calls reach the server that holds their state.
* **failover**: a server that refuses or drops connections is passed over (``max_fails=1``) and the call goes to
  the next one on the hash ring (``grpc_next_upstream error timeout``, nothing of the call having been sent yet); a
  call cut off mid-way ends UNAVAILABLE (nginx's 502), which clients retry.
* **security**: TLS towards clients (``--tls-cert``/``--tls-key``, mutual with ``--tls-client-ca``), TLS towards
  servers (``grpcs://`` verified with ``--backend-ca``), and the clients' static token checked before a call is
  forwarded (UNAUTHENTICATED otherwise); the token itself passes through to the servers.

:class:`NginxProxy` writes the configuration into a folder of its own, checks it with ``nginx -t`` and runs nginx in
the foreground as a child process (``daemon off``), reloading it (``SIGHUP``) when the servers' models change.

Concurrency: a :class:`NginxProxy` is used from one thread.
"""

from __future__ import annotations

import logging
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from splitfed.channel.wire.limits import CLIENT_ID_KEY, MODEL_KEY
from splitfed.channel.routing.discovery import Discovery
from splitfed.errors import ConfigError

__all__ = ["NginxProxy", "NginxSettings", "check", "nginx_binary", "nginx_version", "render"]

log = logging.getLogger(__name__)

#: Model names and tokens the configuration can quote as they are.
_PLAIN = re.compile(r"^[A-Za-z0-9._~+/=:@-]+$")
_GRPC_NOT_FOUND, _GRPC_UNAUTHENTICATED = 5, 16


@dataclass(frozen=True)
class NginxSettings:
    """How nginx listens and reaches the trunk servers.

    Args:
        host, port: where nginx listens (an explicit port: nginx cannot report one it picked).
        tls_cert, tls_key: TLS towards clients (PEM files); None: plaintext (HTTP/2 without TLS).
        tls_client_ca: require client certificates signed by this CA (mutual TLS).
        backend_ca: reach the servers over TLS, verified against this CA; None: plaintext.
        backend_tls_name: the name the servers' certificates are checked against (default: the first server's host).
        backend_cert, backend_key: the client certificate nginx presents to servers that require mutual TLS.
        token: the static token clients must send (``authorization: Bearer``); None: nginx checks none.
        workers: nginx worker processes ("auto": one per core).
        call_timeout_s: longest silence in a call (a sync barrier, a slow generation step) before nginx ends it.
        fail_timeout_s: how long a server that failed a connection is passed over.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    backend_ca: str | None = None
    backend_tls_name: str | None = None
    backend_cert: str | None = None
    backend_key: str | None = None
    token: str | None = None
    workers: str = "auto"
    call_timeout_s: int = 3600
    fail_timeout_s: int = 10

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("give both tls_cert and tls_key for TLS towards clients, or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if bool(self.backend_cert) != bool(self.backend_key):
            raise ConfigError("give both backend_cert and backend_key (nginx's client certificate), or neither")
        if (self.backend_cert or self.backend_tls_name) and not self.backend_ca:
            raise ConfigError("backend_cert and backend_tls_name need backend_ca (TLS towards the trunk servers)")
        if self.token is not None and not _PLAIN.match(self.token):
            raise ConfigError("the client token holds characters nginx's configuration cannot match as they are; "
                              "use a token of letters, digits and ._~+/=:@- (splitfed's --token-file makes one)")


def nginx_binary() -> str:
    """The ``nginx`` executable on PATH (or in /usr/sbin).

    Raises:
        ConfigError: nginx is not installed.
    """
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise ConfigError("nginx is not installed: install it (Debian/Ubuntu: apt-get install nginx) or use the "
                          "Python router (--proxy python)")
    return found


def nginx_version(binary: str) -> tuple[int, ...]:
    """nginx's version, e.g. (1, 22, 1)."""
    out = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=30)
    found = re.search(r"nginx/(\d+(?:\.\d+)*)", out.stderr + out.stdout)
    if found is None:
        raise ConfigError(f"cannot read nginx's version from {out.stderr.strip()!r}")
    return tuple(int(p) for p in found.group(1).split("."))


def _quoted(text: str, what: str) -> str:
    if not _PLAIN.match(text):
        raise ConfigError(f"{what} {text!r} holds characters nginx's configuration cannot match as they are; name it "
                          "with letters, digits and ._~+/=:@-")
    return f'"{text}"'


def _header_var(key: str) -> str:
    return "$http_" + key.replace("-", "_")


def render(settings: NginxSettings, found: Discovery, prefix: Path, version: tuple[int, ...] = (1, 22)) -> str:
    """The nginx configuration routing to the servers in ``found``; runtime files go under ``prefix``."""
    model_header, client_header = _header_var(MODEL_KEY), _header_var(CLIENT_ID_KEY)
    scheme = "grpcs" if settings.backend_ca else "grpc"
    lines = [
        "# Written by `splitfed route --proxy nginx` from the trunk servers' models; rewritten when they change.",
        "daemon off;",
        f"worker_processes {settings.workers};",
        f"pid {prefix / 'nginx.pid'};",
        f"error_log {prefix / 'error.log'} warn;",
        "events { worker_connections 4096; }",
        "http {",
        "    access_log off;",
        "    server_tokens off;",
    ]
    lines += [f"    {kind}_temp_path {prefix / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")]
    lines += [
        "    # The call's model picks the group of servers that serve it.",
        f"    map {model_header} $splitfed_upstream {{",
        "        default splitfed_unknown_model;",
        '        "" splitfed_any;',
    ]
    groups: dict[str, tuple[str, ...]] = {"splitfed_any": found.backends}
    for i, (model, addresses) in enumerate(sorted(found.models.items())):
        lines.append(f"        {_quoted(model, 'the model name')} splitfed_model_{i};  # {model}")
        groups[f"splitfed_model_{i}"] = addresses
    lines += [
        "    }",
        "    # Sticky: a client's id (its connection when it sends none) is the hash key.",
        f"    map {client_header} $splitfed_route_key {{",
        '        "" $remote_addr:$remote_port;',
        f"        default {client_header};",
        "    }",
    ]
    if settings.token is not None:
        token = re.escape(settings.token)
        lines += [
            "    map $http_authorization $splitfed_authorized {",
            "        default 0;",
            f'        "~*^bearer\\s+{token}\\s*$" 1;',
            "    }",
        ]
    for name, addresses in groups.items():
        lines += [f"    upstream {name} {{", "        hash $splitfed_route_key consistent;"]
        lines += [f"        server {a} max_fails=1 fail_timeout={settings.fail_timeout_s}s;" for a in addresses]
        lines += ["        keepalive 64;", "        keepalive_requests 1000000;", "    }"]
    timeout = f"{settings.call_timeout_s}s"
    tls = " ssl" if settings.tls_cert else ""
    h2_directive = version >= (1, 25, 1)
    lines += [
        "    server {",
        f"        listen {_listen_address(settings.host, settings.port)}{tls}{'' if h2_directive else ' http2'};",
    ]
    if h2_directive:
        lines.append("        http2 on;")
    if settings.tls_cert:
        lines += [f"        ssl_certificate {Path(settings.tls_cert).resolve()};",
                  f"        ssl_certificate_key {Path(settings.tls_key or '').resolve()};",
                  "        ssl_protocols TLSv1.2 TLSv1.3;"]
        if settings.tls_client_ca:
            lines += [f"        ssl_client_certificate {Path(settings.tls_client_ca).resolve()};",
                      "        ssl_verify_client on;"]
    lines += [
        "        client_max_body_size 0;  # the trunk servers enforce their own message limits",
        "        client_body_buffer_size 1m;",
        "        grpc_buffer_size 1m;",
        f"        client_body_timeout {timeout};",
        f"        grpc_read_timeout {timeout};",
        f"        grpc_send_timeout {timeout};",
        f"        keepalive_timeout {timeout};",
        "        keepalive_requests 1000000;",
        "        grpc_socket_keepalive on;",
        "        grpc_next_upstream error timeout;",
        f"        grpc_next_upstream_tries {max(len(found.backends), 1)};",
    ]
    if settings.backend_ca:
        name = settings.backend_tls_name or _host(found.backends[0])
        lines += [f"        grpc_ssl_trusted_certificate {Path(settings.backend_ca).resolve()};",
                  "        grpc_ssl_verify on;", f"        grpc_ssl_name {name};", "        grpc_ssl_server_name on;",
                  "        grpc_ssl_protocols TLSv1.2 TLSv1.3;"]
        if settings.backend_cert:
            lines += [f"        grpc_ssl_certificate {Path(settings.backend_cert).resolve()};",
                      f"        grpc_ssl_certificate_key {Path(settings.backend_key or '').resolve()};"]
    served = ", ".join(sorted(found.models)) or "none"
    lines += [
        "        location / {",
        "            error_page 418 = @splitfed_unknown_model;",
        "            error_page 419 = @splitfed_unauthenticated;",
    ]
    if settings.token is not None:
        lines.append("            if ($splitfed_authorized = 0) { return 419; }")
    lines += [
        "            if ($splitfed_upstream = splitfed_unknown_model) { return 418; }",
        f"            grpc_pass {scheme}://$splitfed_upstream;",
        "        }",
        *_grpc_answer("splitfed_unknown_model", _GRPC_NOT_FOUND,
                      f"no trunk server behind this proxy serves the model named in {MODEL_KEY}; "
                      f"it routes the models {served}"),
        *_grpc_answer("splitfed_unauthenticated", _GRPC_UNAUTHENTICATED,
                      "wrong or missing token: send authorization: Bearer <token>, the token the operator gave you"),
        "    }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def _grpc_answer(location: str, code: int, message: str) -> list[str]:
    """A named location answering a gRPC status of nginx's own (a trailers-only response)."""
    return [
        f"        location @{location} {{",
        "            default_type application/grpc;",
        f"            add_header grpc-status {code} always;",
        f'            add_header grpc-message "{message}" always;',
        "            return 204;",
        "        }",
    ]


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def _listen_address(host: str, port: int) -> str:
    return f"[{host.strip('[]')}]:{port}" if ":" in host.strip("[]") else f"{host}:{port}"


def check(binary: str, conf: Path, prefix: Path) -> None:
    """``nginx -t`` on ``conf``.

    Raises:
        ConfigError: nginx refuses the configuration (its own words in the message).
    """
    out = subprocess.run([binary, "-t", "-q", "-p", str(prefix), "-e", "stderr", "-c", str(conf)],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise ConfigError(f"nginx refuses the configuration {conf}: {(out.stderr or out.stdout).strip()}")


class NginxProxy:
    """nginx in front of the trunk servers, as a child process of this one.

    Quickstart::

        found = discover(["127.0.0.1:50052", "127.0.0.1:50053"])
        with NginxProxy(NginxSettings(port=50051), found, Path("/tmp/route")) as proxy:
            proxy.wait()

    Args:
        settings: how it listens and reaches the servers.
        found: which server serves which model.
        directory: where the configuration, the error log and nginx's runtime files go (created).
    """

    def __init__(self, settings: NginxSettings, found: Discovery, directory: Path) -> None:
        self.settings = settings
        self.found = found
        self.directory = Path(directory).resolve()
        self.conf = self.directory / "nginx.conf"
        self.binary = nginx_binary()
        self.version = nginx_version(self.binary)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """``host:port`` clients dial."""
        return _listen_address(self.settings.host, self.settings.port)

    def write(self) -> Path:
        """Write the configuration (mode 0600: it may hold the clients' token) and check it; returns its path."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o755)  # nginx's workers (another user when it runs as root) traverse it
        text = render(self.settings, self.found, self.directory, self.version)
        fresh = self.conf.with_suffix(".new")
        fresh.touch(mode=0o600)
        fresh.write_text(text)
        check(self.binary, fresh, self.directory)
        fresh.replace(self.conf)
        return self.conf

    def start(self, ready_timeout_s: float = 30.0) -> NginxProxy:
        """Write, check and start nginx; returns once it accepts connections.

        Raises:
            ConfigError: nginx refuses the configuration, exits, or does not listen in time.
        """
        self.write()
        self.process = subprocess.Popen([self.binary, "-p", str(self.directory), "-e", "stderr", "-c",
                                         str(self.conf)], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + ready_timeout_s
        while not self._listening():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop(grace=0)
                raise ConfigError(f"nginx did not start listening on {self.address}: {self._log_tail()}")
            time.sleep(0.05)
        log.info("nginx (pid %d) listening on %s in front of %s; %s", self.process.pid, self.address,
                 ", ".join(self.found.backends), self.found.describe())
        return self

    def update(self, found: Discovery) -> bool:
        """Rewrite the configuration for ``found`` and reload nginx (calls in flight finish on the old workers);
        returns whether anything changed."""
        if found == self.found:
            return False
        self.found = found
        self.write()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGHUP)
        log.info("nginx reloaded: %s", found.describe())
        return True

    def stop(self, grace: float | None = 5.0) -> int | None:
        """Stop nginx (gracefully: calls in flight get ``grace`` seconds); returns its exit status."""
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGQUIT if grace else signal.SIGTERM)
            try:
                proc.wait(timeout=(grace or 0) + 5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until nginx exits (or ``timeout``); returns its exit status (None: still running)."""
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def _listening(self) -> bool:
        host = self.settings.host.strip("[]")
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
        try:
            with socket.create_connection((host, self.settings.port), timeout=0.5):
                return True
        except OSError:
            return False

    def _log_tail(self) -> str:
        try:
            return (self.directory / "error.log").read_text()[-2000:].strip() or "(its error log is empty)"
        except OSError:
            return "(no error log)"

    def __enter__(self) -> NginxProxy:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
