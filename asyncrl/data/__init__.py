"""Prompt data: file datasets (``datasets.py``) and the synthetic arithmetic task (``synthetic.py``)."""
