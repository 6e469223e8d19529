"""Models built locally: the embedded tiny default (see ``tiny.py``)."""
