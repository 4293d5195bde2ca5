"""Checks on the checkout as a whole: docs, the import layers, the locks, the chart, the image."""
