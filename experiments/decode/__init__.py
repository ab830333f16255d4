"""Decode: the offloaded decode step and loop against resident, one or many processes."""
