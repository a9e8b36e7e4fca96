"""Core: what every stage shares: the typed artifacts passed between stages, the variant type,
paths, settings, errors, logging, processes, the hardware profile and MLflow tracking."""
