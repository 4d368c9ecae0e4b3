"""Adapters that turn code written for another framework into an `elastic.TrainJob`.

Each lives in its own module and imports its framework there; the core never imports them.
"""
