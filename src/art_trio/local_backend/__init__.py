"""What art_trio's two local ART backends share (neither core nor specific to one of them).

* ``server``: the OpenAI-compatible chat-completions app (request validation, OpenAI's error
  shapes, ``GET /v1/models``) and ``ServedBackend``, which serves it for as long as a
  backend's ``async with`` block runs, under trio or asyncio;
* ``limits``: the completion-token settings (the default of a request that names no
  ``max_tokens``, the per-request limit), checked together before any model loads;
* ``versions``: ``LocalBackend``, the ART ``Backend`` methods about steps: ART's checkpoint
  layout, ``name@step`` inference names, ``_get_step``, checkpoint deletion, adapter leases
  and which steps stay in memory.

Used by ``art_trio.demo.CpuBackend`` (a numpy policy) and ``art_trio.cpu.CPUBackend`` (a real
language model on transformers + peft).
"""
