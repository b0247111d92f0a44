"""Bytes on the wire: the HTTP/1.1 client the completion legs reach the nodes with, and the ASGI response that
relays a streamed answer to the client."""
