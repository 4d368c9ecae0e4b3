"""One worker's model replica and its training step; no Ray here."""
