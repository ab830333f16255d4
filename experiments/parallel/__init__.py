"""Parallel layouts: how the model is split over many devices, measured."""
