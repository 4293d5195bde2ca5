"""The router as a whole, end to end: streaming, faults, secrets, workers."""
