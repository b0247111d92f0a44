"""Client-facing APIs, a room each, every one served by turns of the internal Chat Completions path.

- ``chat/``: Chat Completions and Completions, the path itself;
- ``messages/``: Anthropic Messages, lowered to a chat turn and raised back, and ``count_tokens``;
- ``responses/``: OpenAI Responses, the same way, with the stored responses and conversations it keeps.

Each room exports ``TURNS`` (its POST paths served as turns, with the edge that lowers and raises them) and
``ROUTES`` (its other routes); the shell serves them all. Shared by the rooms: ``endpoint.py`` (the one
endpoint every turn goes through), ``validate.py`` (what the gateway accepts), ``edge.py`` (a chat answer
raised back into another API's shape as it leaves), ``hosted.py`` (hosted tools a turn dropped), and
``serving.py`` (what the rooms read of the gateway).
"""
