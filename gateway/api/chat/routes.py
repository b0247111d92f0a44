"""The chat room's routes: ``POST /v1/chat/completions`` and ``POST /v1/completions``, turns as they came."""

from __future__ import annotations

from kvtether.gateway.api.endpoint import TurnRoute
from kvtether.gateway.turn.context import PATHS
from starlette.routing import Route

TURNS = (TurnRoute(PATHS["chat"], "chat", "chat"), TurnRoute(PATHS["completions"], "completions", "completions"))
ROUTES: tuple[Route, ...] = ()
