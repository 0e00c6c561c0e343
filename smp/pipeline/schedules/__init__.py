"""Schedule builders: SMP v1's dynamic rules and the static 1F1B family (internal; see the registry)."""
