"""Engines: one module per inference library, each implementing engines.base.Engine."""
