"""Hostile peers: attacking targets and wire clients against a hub; a hostile hub for targets."""
