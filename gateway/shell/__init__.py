"""The HTTP shell: the ASGI app and its routes, the server, callers' keys, validation, errors, and the API edge."""
