"""Anthropic Messages (``/v1/messages``), lowered to the chat path at the edge and its answer raised back.

``routes.py``: the room's routes (a turn, and ``count_tokens``); ``lowering.py``: the request's chat body and
session, the answer in Messages' shape. The translation itself is ``kvtether.protocol.messages`` (pure).
"""

from kvtether.gateway.api.messages.routes import ROUTES, TURNS

__all__ = ["ROUTES", "TURNS"]
