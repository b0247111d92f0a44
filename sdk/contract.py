"""The wire contract under the SDK's name: ``kvtether.protocol.contract``, re-exported.

The session headers and the prefix-hash chain live in ``kvtether.protocol.contract``, the room the gateway, the
simulator and the SDK all import, so the gateway reads them without importing the client SDK. This module keeps
``from kvtether.sdk.contract import …`` working: the same objects, not copies.
"""

from __future__ import annotations

from kvtether.protocol.contract import (
    CONTRACT_VERSION,
    FINAL_HEADER,
    FOREIGN_FINAL_HEADERS,
    FOREIGN_SESSION_HEADERS,
    PREFIX_HEADER,
    PREFIX_PARENT_HEADER,
    RENDERING_FIELDS,
    SESSION_END_PATH,
    SESSION_HEADER,
    TRACEPARENT_HEADER,
    TURN_HEADER,
    Chain,
    Stamps,
    canonical_anthropic_content,
    canonical_json,
    canonical_message,
    canonical_response_item,
    chain_seed,
    is_model_item,
    messages_rendering,
    prefix_chain,
    rendering_fields,
    responses_rendering,
    session_final_from_headers,
    session_id_from_headers,
    stamps_for_body,
    stamps_for_messages_body,
    stamps_for_responses_body,
    turn_index,
)

__all__ = [
    "CONTRACT_VERSION",
    "FINAL_HEADER",
    "FOREIGN_FINAL_HEADERS",
    "FOREIGN_SESSION_HEADERS",
    "PREFIX_HEADER",
    "PREFIX_PARENT_HEADER",
    "RENDERING_FIELDS",
    "SESSION_END_PATH",
    "SESSION_HEADER",
    "TRACEPARENT_HEADER",
    "TURN_HEADER",
    "Chain",
    "Stamps",
    "canonical_anthropic_content",
    "canonical_json",
    "canonical_message",
    "canonical_response_item",
    "chain_seed",
    "is_model_item",
    "messages_rendering",
    "prefix_chain",
    "rendering_fields",
    "responses_rendering",
    "session_final_from_headers",
    "session_id_from_headers",
    "stamps_for_body",
    "stamps_for_messages_body",
    "stamps_for_responses_body",
    "turn_index",
]
