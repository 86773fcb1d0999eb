"""Show measurements: rich tables for the terminal and matplotlib (Agg) PNG figures."""
