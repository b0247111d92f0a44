"""OpenAI Responses (``/v1/responses``), lowered to the chat path at the edge, with the state the gateway keeps
for it: stored responses (``previous_response_id``) and conversations.

``routes.py``: the room's routes (a turn; the stored responses' GET, DELETE, input items and cancel; the 426
for WebSocket); ``lowering.py``: the request's chat body and session, the answer in Responses' shape;
``state.py``: the records in the session store. The translation itself is ``kvtether.protocol.responses``.
"""

from kvtether.gateway.api.responses.routes import ROUTES, TURNS

__all__ = ["ROUTES", "TURNS"]
