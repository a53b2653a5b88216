"""The HTTP face: the app (``app.py``, served by ``server.py``), what its APIs share (``core.py``), one module per
API (``openai_api.py``, ``anthropic_api.py``, ``cached_contents.py``), their request and response bodies
(``protocol.py``), chat templates (``chat.py``), the key/usage store (``store.py``) and the admin API
(``admin.py``)."""
