"""elbowroom: a local inference server that measures, budgets, isolates and evicts models
so that memory exhaustion never takes the machine down."""

__version__ = "0.1.0"
