"""Routing: the router's hot paths, trace replay under each policy, shared-prefix routing, a fresh frontend's warm-up."""
