"""Calling asyncio code (ART and users' callbacks) from the trainer, whatever loop it runs on:
the only package that knows trio-asyncio. `calls.py` is the bridge itself (what crosses, how
cancellation and errors come back; its docstring tells), `loop.py` tunes the trio-asyncio
loop it opens, `default_executor.py` is the asyncio code's default executor, and
`blocking.py`, which it loads at the first blocking call, where those calls run, so that no
stop waits for one.
"""
