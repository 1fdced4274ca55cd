"""Layer 4, settings: how a run is configured (the declared settings, ART's keywords, the
backends a trainer accepts)."""
