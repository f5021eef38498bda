"""Fleets of servers."""
