"""Mixture-of-experts block: router, routed-expert backends."""
