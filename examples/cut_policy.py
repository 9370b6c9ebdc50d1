"""A cut policy: each node's cut depth picked from its ``node_config`` (here, the memory it reports).

``python examples/cut_policy.py`` prints, for four nodes of different memory,
the cut each gets, the ``--node-config`` to start its SuperNode with, and the
``client-cuts`` value of the run.

Heterogeneous cut depth (``client-cuts``): a client with cut ``(a, b)`` holds
blocks ``[0, a)`` and ``[b, n)``; the trunk holds ``[min a, max b)`` over the
run's ``client-cuts`` and runs ``[a, b)`` for that client. ``client-cuts`` assigns
cuts by partition id; a node's ``cuts`` node-config value (``"a,b"``) overrides
its entry. So a policy has two outputs: the run's ``client-cuts`` (every cut the
policy may hand out, so the trunk's range covers them all) and each node's
``cuts``. A node with little memory keeps few blocks (a shallow bottom, the trunk
runs the rest); a strong node keeps more.

Two ways to apply it: compute ``cuts`` when you start each SuperNode
(:meth:`MemoryCutPolicy.node_config`), or let the ClientApp pick at run time
from what the node reports (:data:`app`: the project's ClientApp after the policy
set ``cuts``; point ``clientapp`` at ``examples.cut_policy:app`` and add
``"examples/*.py"`` to ``fab-include``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from flwr.app import Context, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from splitfed.config import parse_client_cuts  # noqa: E402

#: node-config keys: what the node reports, and the cut it gets (the key ``client-cuts`` runs read).
MEMORY_KEY = "memory-gb"
CUTS_KEY = "cuts"


@dataclass(frozen=True)
class MemoryCutPolicy:
    """Cuts by memory tier: the first tier whose ``min_gb`` the node's memory reaches.

    Args:
        tiers: ``(min_gb, (a, b))`` from the most demanding tier down; the last one should have ``min_gb = 0``.
    """

    tiers: tuple[tuple[float, tuple[int, int]], ...]

    def cut_for(self, node_config: Mapping[str, Any]) -> tuple[int, int]:
        """The cut of a node that reports ``memory-gb`` (a node that reports nothing gets the last tier)."""
        memory = float(node_config.get(MEMORY_KEY, 0.0))
        for min_gb, cut in self.tiers:
            if memory >= min_gb:
                return cut
        return self.tiers[-1][1]

    def client_cuts(self) -> str:
        """The run's ``client-cuts``: every cut this policy hands out, so the trunk holds all their blocks."""
        text = " ".join(f"{a},{b}" for _, (a, b) in self.tiers)
        parse_client_cuts(text)  # the run config's own check
        return text

    def node_config(self, node_config: Mapping[str, Any]) -> dict[str, Any]:
        """``node_config`` with ``cuts`` set by the policy (a ``cuts`` the operator gave is kept)."""
        out = dict(node_config)
        if not out.get(CUTS_KEY):
            a, b = self.cut_for(node_config)
            out[CUTS_KEY] = f"{a},{b}"
        return out


#: For the main job's MNIST CNN (blocks 0-9, run cuts 3,6): small nodes keep the first convolution only.
POLICY = MemoryCutPolicy(((4.0, (3, 6)), (0.0, (1, 6))))


def supernode_flag(node_config: Mapping[str, Any]) -> str:
    """The ``--node-config`` value to start a SuperNode with."""
    items = []
    for key, value in node_config.items():
        items.append(f"{key}='{value}'" if isinstance(value, str) else f"{key}={value}")
    return " ".join(items)


app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """The project's train handler, on a node whose ``cuts`` the policy set."""
    from splitfed.apps import client_app

    context.node_config.update(POLICY.node_config(context.node_config))
    return client_app.train(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The project's evaluate handler, on a node whose ``cuts`` the policy set."""
    from splitfed.apps import client_app

    context.node_config.update(POLICY.node_config(context.node_config))
    return client_app.evaluate(msg, context)


def main() -> dict[str, Any]:
    """Four nodes of different memory: their cuts and SuperNode flags, and the run's ``client-cuts``."""
    nodes = [{"partition-id": i, "num-partitions": 4, MEMORY_KEY: gb} for i, gb in enumerate((16.0, 2.0, 8.0, 1.0))]
    configs = [POLICY.node_config(n) for n in nodes]
    sys.stdout.write(f"run config:  client-cuts='{POLICY.client_cuts()}'\n")
    for config in configs:
        sys.stdout.write(f"node {config['partition-id']} ({config[MEMORY_KEY]:>4} GB): cut {config[CUTS_KEY]:<5} "
                         f"flower-supernode --node-config \"{supernode_flag(config)}\"\n")
    return {"client-cuts": POLICY.client_cuts(), "nodes": configs}


if __name__ == "__main__":
    main()
