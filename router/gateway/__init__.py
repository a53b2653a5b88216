"""The HTTP face: the app (``app.py``, served by ``server.py``), one replica's ``Gateway`` and its parts
(``core.py``: admission, prompts, generation, accounting), one folder per API (``openai/``, ``anthropic/``,
``gemini/``: protocol, serving, errors), chat templates (``chat.py``), the key/usage store (``store.py``) and the
admin API (``admin.py``)."""
