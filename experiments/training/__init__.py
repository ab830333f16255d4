"""The small model: training, the MTP layer, export as a model directory, parity fixtures."""
