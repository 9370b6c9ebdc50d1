"""What zero-configuration TLS costs: ``python -m bench.tls [--reps N] [--json FILE]``.

Issues ephemeral CAs and server certificates (what the ServerApp does once per start), then sends
activations of 16 KiB, 1 MiB and 16 MiB through two trunk servers on loopback, one in plaintext and one over
TLS pinned to the issued CA, alternating, and prints the median forward round trip of each (evaluation
forwards through an identity trunk, so only the channel is measured).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from splitfed.channel.security.autotls import issue, san_hosts
from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.channel.security.policy import (
    ServerTransport,
    TransportMode,
    client_credentials,
)
from splitfed.split import CutState

SIZES = (16 << 10, 1 << 20, 16 << 20)


def issue_ms(reps: int = 20) -> float:
    """Mean milliseconds to issue a CA and a server certificate."""
    start = time.perf_counter()
    for _ in range(reps):
        issue(san_hosts("10.0.0.1", "0.0.0.0"))
    return (time.perf_counter() - start) / reps * 1000


def forward_ms(nbytes: int, reps: int) -> tuple[float, float]:
    """Median milliseconds of one evaluation forward of ``nbytes`` through a loopback trunk server, in plaintext
    and over TLS; the two alternate forward by forward, so load from elsewhere falls on both alike."""
    transport = ServerTransport(TransportMode.AUTO_TLS, bind="127.0.0.1", issued=issue(["127.0.0.1"]))
    plain_server = TrunkServer(nn.Identity(), insecure=True).start()
    tls_server = TrunkServer(nn.Identity(), insecure=False, credentials=transport.credentials()).start()
    clients = (TrunkClient(plain_server.address, insecure=True),
               TrunkClient(tls_server.address, credentials=client_credentials(tls_server.address,
                                                                              pinned_ca=transport.ca_pem)))
    try:
        state = CutState(torch.randn(nbytes // 4 // 256, 256))
        times: tuple[list[float], list[float]] = ([], [])
        for client in clients:
            client.forward(state, train=False)  # connect (and handshake) outside the timing
        for _ in range(reps):
            for client, kept in zip(clients, times):
                start = time.perf_counter()
                client.forward(state, train=False)
                kept.append(time.perf_counter() - start)
        return statistics.median(times[0]) * 1000, statistics.median(times[1]) * 1000
    finally:
        for client in clients:
            client.close()
        plain_server.stop(0)
        tls_server.stop(0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20, help="forwards per size and mode")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = {"issue-ms": issue_ms(), "forward-ms": []}
    print(f"issuing a CA and a server certificate: {results['issue-ms']:.2f} ms")
    print(f"{'activation':>12} {'plaintext ms':>13} {'TLS ms':>8} {'TLS / plaintext':>16}")
    for nbytes in SIZES:
        plain, tls = forward_ms(nbytes, args.reps)
        results["forward-ms"].append({"bytes": nbytes, "plaintext": plain, "tls": tls})
        print(f"{nbytes / 1024:>9.0f} KiB {plain:>13.2f} {tls:>8.2f} {tls / plain:>16.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
