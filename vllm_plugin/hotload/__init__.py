"""Hot-load for vLLM: two thin adapters of :class:`deltasync.Replica` (the protocol and state machine live in
:mod:`deltasync`): :mod:`.endpoint` (the HTTP API on the OpenAI server, a ``vllm.endpoint_plugins`` entry point, over
:class:`.engine.ServerEngine`) and :mod:`.offline` (an offline ``vllm.LLM``)."""
