"""Prompt-cache epochs for ``reset_prompt_cache="new_session"``: sessions seen before a swap keep their cached
prefixes, new sessions start from prefixes computed with the new weights, and nothing running is touched.

vLLM keys its prefix cache on the request's ``cache_salt`` (the first block's hash includes it, every later block
chains from it: ``v1/core/kv_cache_utils.py``). The hot-load endpoint gives every ``/v1/completions`` and
``/v1/chat/completions`` request a salt derived from an **epoch**: a session's epoch is the one current when the
server first saw the session, a request without a session gets the current epoch. A ``new_session`` swap starts a new
epoch instead of dropping the cache: requests of existing sessions still hash to their old prefixes, everyone else to
the new epoch's (empty at first). The session is the ``x-zerokld-session-id`` header, else the OpenAI ``user`` field.
A salt the client sent itself is kept (hashed together with the epoch, so its isolation holds). Sessions are
remembered up to :data:`MAX_SESSIONS` (least recently seen forgotten first: a forgotten session counts as new).

Source: Fireworks' hot-load ``reset_prompt_cache`` modes (``../shared/DESIGN.md`` §5); vLLM's ``cache_salt``.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

__all__ = ["CacheEpochs", "MAX_SESSIONS", "SALTED_ROUTES"]

MAX_SESSIONS = 100_000
#: the routes whose requests are salted (the generation routes that take ``cache_salt``)
SALTED_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})


class CacheEpochs:
    """The current epoch (numbered from 0) and each session's epoch."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.epoch, self.max_sessions = 0, max_sessions
        self.sessions: OrderedDict[str, int] = OrderedDict()

    def salt(self, session: str | None, client_salt: str | None = None) -> str:
        """The ``cache_salt`` for a request of ``session`` (``None``: no session) that sent ``client_salt``: 32 hex
        characters (within vLLM's salt rules: at most 128, no ``@`` or ``/``)."""
        epoch = self.epoch
        if session is not None:
            epoch = self.sessions.setdefault(session, self.epoch)
            self.sessions.move_to_end(session)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        return hashlib.sha256(f"{client_salt or ''}\0{epoch}".encode()).hexdigest()[:32]

    def new_epoch(self, forget_sessions: bool = False) -> None:
        """Start the next epoch for new sessions and session-less requests (``forget_sessions``: for every session
        too)."""
        self.epoch += 1
        if forget_sessions:
            self.sessions.clear()
