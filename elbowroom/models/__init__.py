"""Models: the catalog (what can be served) and footprint estimates (what it will cost)."""
