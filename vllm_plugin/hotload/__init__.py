"""Delta hot-load for vLLM: :mod:`.manager` (ledger, verify, swap) and :mod:`.endpoint` (the HTTP API, a
``vllm.endpoint_plugins`` entry point)."""
