"""Prompt-cache epochs for ``reset_prompt_cache="new_session"``: sessions seen before a swap keep their cached
prefixes, new sessions start from prefixes computed with the new weights, and nothing running is touched.

vLLM keys its prefix cache on the request's ``cache_salt`` (the first block's hash includes it, every later block
chains from it: ``v1/core/kv_cache_utils.py``). The hot-load endpoint gives every ``/v1/completions`` and
``/v1/chat/completions`` request — and SageMaker's ``/invocations``, which serves the same two request types — a salt
derived from an **epoch**: a session's epoch is the one current when the
server first saw the session, a request without a session gets the current epoch. A ``new_session`` swap starts a new
epoch instead of dropping the cache: requests of existing sessions still hash to their old prefixes, everyone else to
the new epoch's (empty at first). The session is the ``x-zerokld-session-id`` header, else the OpenAI ``user`` field.
A salt the client sent itself is kept (hashed together with the epoch, so its isolation holds). Sessions are
remembered up to :data:`MAX_SESSIONS` (least recently seen forgotten first: a forgotten session counts as new).

While such an isolation is in force (:attr:`CacheEpochs.isolating`: from a ``new_session`` swap until a reset drops
every cached prefix), the endpoint refuses (409) every other POST route that could read the prefix cache
(``/v1/responses``, ``/v1/messages``, ...): they take no salt, so they would reuse prefixes computed with the old
weights under the new identity. Routes that never read it (:data:`CACHE_FREE_ROUTES`, renderers) stay open.

Source: Fireworks' hot-load ``reset_prompt_cache`` modes (``docs/design.md`` §5); vLLM's ``cache_salt``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

__all__ = ["CACHE_FREE_ROUTES", "CacheEpochs", "MAX_SESSIONS", "SALTED_ROUTES", "isolation_refuses"]

MAX_SESSIONS = 100_000
#: the routes whose requests are salted (the generation routes that take ``cache_salt``)
SALTED_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations"})
#: POST routes that never read the prefix cache (vLLM 0.32's tokenizer, adapter and admin routes; ``*/render`` and
#: ``*/derender`` too): open while a ``new_session`` isolation is in force
CACHE_FREE_ROUTES = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/v1/messages/count_tokens",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        "/start_profile",
        "/stop_profile",
    }
)


def isolation_refuses(method: str, path: str) -> bool:
    """Whether a request must be refused while a ``new_session`` isolation is in force: a POST to a route that is
    neither salted (:data:`SALTED_ROUTES`) nor free of the prefix cache."""
    return (
        method == "POST"
        and path not in SALTED_ROUTES
        and path not in CACHE_FREE_ROUTES
        and not path.endswith(("/render", "/derender"))
    )


class CacheEpochs:
    """The current epoch (numbered from 0) and each session's epoch."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self.epoch, self.max_sessions = 0, max_sessions
        self.sessions: OrderedDict[str, int] = OrderedDict()
        #: a ``new_session`` swap left prefixes computed with earlier weights in the cache (until a full reset)
        self.isolating = False

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
        self.isolating = not forget_sessions
        if forget_sessions:
            self.sessions.clear()
