"""Routing: one address in front of several trunk servers (:class:`Router`), sticky per client, by load and model."""

from splitfed.channel.routing.router import Router
from splitfed.channel.routing.table import BackendState, RouteTable

__all__ = ["BackendState", "RouteTable", "Router"]
