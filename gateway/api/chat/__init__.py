"""Chat Completions and Completions: the gateway's own path, which every other API's turn is lowered to.

``routes.py``: the room's routes. A request here needs no translation: ``api/endpoint.py`` checks it and hands
it to the turn (``turn/orchestrator.py``) as it came.
"""

from kvtether.gateway.api.chat.routes import ROUTES, TURNS

__all__ = ["ROUTES", "TURNS"]
