"""Trace replay: the Alibaba GPU trace as DRA objects, arrival sequences, and policy comparisons."""
