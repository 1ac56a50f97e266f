"""The routers' books in this process, by deployment name: the ingress's admission, /health and
/metrics read the view its router routes on.

A module of its own because Ray Serve ships the router class to the ingress by value
(cloudpickle): module globals of the router's own module arrive as copies, so the router
registers its book here, through an import at call time, in the one real module."""

from __future__ import annotations

from engine.fleet.routing import FleetBook

_BOOKS: dict[str, FleetBook] = {}


def register(deployment_name: str, book: FleetBook) -> None:
    _BOOKS[deployment_name] = book


def fleet_book(deployment_name: str) -> FleetBook | None:
    """The book of this process's router for `deployment_name` (None before its first request)."""
    return _BOOKS.get(deployment_name)
