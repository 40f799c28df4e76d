"""Models from the Hugging Face Hub: `elbowroom pull` / `rm`, /api/pull, the fit check before a
download (docs/pull.md)."""
