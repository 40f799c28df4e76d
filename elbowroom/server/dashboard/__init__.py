"""The dashboard at /ui: its static page and the one JSON document it and `elbowroom ps
--watch` draw (docs/dashboard.md)."""
