"""The HTTP shell: the ASGI app (the API rooms' routes, health, readiness, metrics, admin), the server, and
several workers on one port."""
