"""Layer 2, plumbing: the outside world (asyncio, files, processes, ART's release lines).

Knows no run and no policy; imports only messages.
"""
